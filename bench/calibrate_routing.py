"""Expert-cache locality of a model's routing: per-layer LRU hit rates over a decode of English text, and the
calibration of make-model's `--routing realistic` skew against the trained model's published figure.

    python bench/calibrate_routing.py report FILE [FILE ...]      LRU hit rate by capacity, one column per file
    python bench/calibrate_routing.py calibrate --preset small    bisect the skew to an 80% hit at 45% capacity
    python bench/calibrate_routing.py calibrate --preset flash --proxy     (or --replay MEDIUM_REALISTIC.gguf)

The measurement: the CPU reference (RefModel, chunked: any chunking gives the token-by-token routing) runs
TOKENS tokens of TEXT, tokenized by the file's own tokenizer, and records every layer's top-k expert ids; each
layer has its own LRU cache of round(capacity * n_expert) experts, empty at the start. A token's experts are looked
up together (hits touched first, then misses placed, never evicting one of the token's own), and hits are counted
after the first WARMUP tokens. The figure is the mean over layers (every layer makes the same number of lookups).

`calibrate` remakes the preset at each skew (the same seed: only the router rows' scales change) and bisects.
`--replay` is for a geometry too large to run here (flash): it records a runnable file's router inputs and routes
them through fresh random routers of the target's expert count and k with the skew's row scales. That transfers
because top-k selection depends only on the direction of the router's input (see strata.model.synth). `--proxy`
records them from the preset's own width and depth, with only the expert count, vocabulary and PLE table shrunk.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.model.loader import Model, load_model  # noqa: E402
from strata.model.synth import LRU_CAPACITY, LRU_TARGET, PRESETS, ROUTING_SKEW, make_model, router_scales  # noqa: E402
from strata.reference.model import RefModel  # noqa: E402
from strata.tokenizer import Tokenizer  # noqa: E402

TOKENS = 512
WARMUP = 128
CHUNK = 64
CAPACITIES = (0.1, 0.2, 0.3, 0.45, 0.6, 0.8)
TOLERANCE = 0.005          # bisection stops within this of the target
# Plain English prose written for this benchmark (not the tokenizer's training text), repeated if a run needs more
TEXT = """\
The river ran brown and fast after the rain, and the ferry waited at the landing until the pilot was sure of the \
current. Passengers stood under the tin roof with their bags at their feet, talking about the price of feed, the \
new teacher, and whether the bridge that had been promised for twenty years would ever be built. A boy sold apples \
from a basket. A woman with a pram counted her change twice and then a third time. When the bell rang they filed \
on board, the cars rolled down the ramp one by one, and the old engine shook the deck as it took the strain.

On the far bank the road climbed through orchards to a village of grey houses with red doors. There was a baker, \
a post office that opened three mornings a week, and a church whose clock had stopped at twenty past four so long \
ago that people gave directions by it. Every autumn the families picked the apples together, working along the \
rows with ladders and wooden crates, and in the evening they pressed the fruit in a barn that smelled of sugar and \
smoke. The cider was sold at the market in town, and the money paid for the school roof, the doctor's visits and \
the dance at the end of the harvest.

Most of the young people left in the end. They went to the cities to study or to work in offices and shops, and \
they came back at weekends with new clothes and new ways of talking. Their parents were proud of them and sad at \
the same time. The village did not get smaller all at once; it thinned, the way a crowd thins at the end of a \
long day, until one winter there were more empty houses than lit ones on the hill.

Then something changed. A couple from the city bought the mill and turned it into a workshop where they made \
furniture from the old orchard wood. A nurse opened a small clinic in the front room of her house. Someone started \
a bus that ran twice a day to the station, and the ferry added an evening crossing in the summer. None of it was \
much on its own, but together it was enough. Children appeared again in the lanes, shouting and racing bicycles, \
and the baker began to make bread on Sundays.

People still argue about the bridge. Some say it would bring the village back to life for good; others say it \
would bring traffic, noise and strangers, and that the river is what keeps the place itself. The ferry pilot, who \
has crossed the water more times than anyone can count, does not take sides. He says that a river is a road that \
moves, and that the trick is to know where it is going before you set out. Then he rings the bell, and the cars \
roll down the ramp, and the engine shakes the deck as it takes the strain.
"""


# ---- the measurement --------------------------------------------------------------------------------------------

class RoutingRecorder(RefModel):
    """The reference model, recording each layer's routed expert ids (and, for replay, its router inputs)."""

    def __init__(self, weights, keep_inputs: bool = False):
        super().__init__(weights)
        self.ids: list[list[np.ndarray]] = [[] for _ in range(self.cfg.n_layer)]      # per layer: (T, k) chunks
        self.inputs: list[list[np.ndarray]] | None = [[] for _ in range(self.cfg.n_layer)] if keep_inputs else None

    def pre(self, b, il, R, ple_e=None):
        p = super().pre(b, il, R, ple_e)
        self.ids[il].append(p.ids)
        if self.inputs is not None:
            self.inputs[il].append(p.x)
        return p


def text_tokens(model: Model, n: int = TOKENS) -> list[int]:
    """n tokens of TEXT (repeated as needed) in the file's own tokenizer."""
    ids = Tokenizer.from_metadata(model.metadata).encode(TEXT)
    return (ids * (n // len(ids) + 1))[:n]


def record(model: Model, n_tokens: int = TOKENS, keep_inputs: bool = False) -> RoutingRecorder:
    rec = RoutingRecorder(model.weights, keep_inputs)
    st = rec.new_state()
    tokens = text_tokens(model, n_tokens)
    for a in range(0, len(tokens), CHUNK):
        rec.chunk(st, tokens[a:a + CHUNK])
    return rec


def layer_ids(rec: RoutingRecorder) -> np.ndarray:
    """(n_layer, T, k) expert ids."""
    return np.stack([np.concatenate(chunks) for chunks in rec.ids])


def lru_hit_rate(ids: np.ndarray, capacity: int, warmup: int = WARMUP) -> float:
    """One layer's LRU of `capacity` experts over ids (T, k); hits / lookups after the first `warmup` tokens."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = lookups = 0
    for t, row in enumerate(ids.tolist()):
        present = [e for e in row if e in cache]
        for e in present:
            cache.move_to_end(e)
        for e in row:
            if e not in cache:
                if len(cache) >= capacity:
                    victim = next(v for v in cache if v not in row)
                    del cache[victim]
                cache[e] = None
        if t >= warmup:
            hits += len(present)
            lookups += len(row)
    return hits / max(lookups, 1)


def capacity_slots(fraction: float, n_expert: int) -> int:
    return max(1, round(fraction * n_expert))


def hit_rate(ids: np.ndarray, n_expert: int, fraction: float = LRU_CAPACITY, warmup: int = WARMUP) -> float:
    """Mean over layers of the LRU hit rate at `fraction` of the experts; ids (n_layer, T, k)."""
    slots = max(capacity_slots(fraction, n_expert), ids.shape[2])
    return float(np.mean([lru_hit_rate(layer, slots, warmup) for layer in ids]))


def locality(ids: np.ndarray, n_expert: int, fraction: float = LRU_CAPACITY, warmup: int = WARMUP,
             seed: int = 0) -> dict[str, float]:
    """Where an LRU's hits come from: the same lookups in shuffled token order (skew alone, no token-to-token
    correlation), an oracle static cache of each layer's most used experts, and the experts two consecutive tokens
    share against two tokens drawn at random."""
    rng = np.random.default_rng(seed)
    L, T, k = ids.shape
    slots = max(capacity_slots(fraction, n_expert), k)
    shuffled = np.mean([lru_hit_rate(layer[rng.permutation(T)], slots, warmup) for layer in ids])
    static, consecutive, random_pair = [], [], []
    for layer in ids:
        counts = np.bincount(layer[warmup:].ravel(), minlength=n_expert)
        static.append(np.sort(counts)[::-1][:slots].sum() / counts.sum())
        onehot = np.zeros((T, n_expert), bool)
        onehot[np.arange(T)[:, None], layer] = True
        consecutive.append((onehot[1:] & onehot[:-1]).sum(1).mean() / k)
        a, b = rng.integers(0, T, (2, 4 * T))
        random_pair.append((onehot[a] & onehot[b]).sum(1).mean() / k)
    return {"lru": hit_rate(ids, n_expert, fraction, warmup), "lru_shuffled": float(shuffled),
            "static_top": float(np.mean(static)), "consecutive_overlap": float(np.mean(consecutive)),
            "random_overlap": float(np.mean(random_pair))}


def measure(path: str | os.PathLike, n_tokens: int = TOKENS) -> tuple[Model, np.ndarray]:
    model = load_model(path)
    return model, layer_ids(record(model, n_tokens))


# ---- replay: a geometry too large to run ------------------------------------------------------------------------

REPLAY_DRAWS = 4          # router draws a replayed hit rate is averaged over (one draw varies by about a point)


def replay_ids(inputs: np.ndarray, n_expert: int, k: int, skew: float, seed: int = 0) -> np.ndarray:
    """Route recorded router inputs (n_layer, T, E) through fresh random routers of n_expert rows (make-model's
    scale: N(0, 1/E)) scaled by router_scales; (n_layer, T, k) ids as route() orders them."""
    L, T, E = inputs.shape
    out = np.empty((L, T, k), np.int32)
    for il in range(L):
        rng = np.random.default_rng([seed, il])
        W = rng.standard_normal((n_expert, E)).astype(np.float32) / np.sqrt(E)
        W *= router_scales(seed, f"replay.{il}", n_expert, skew)[:, None]
        logits = inputs[il] @ W.T                                               # (T, n_expert)
        out[il] = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    return out


def replay_hit_rate(inputs: np.ndarray, n_expert: int, k: int, skew: float, seed: int = 0) -> float:
    """hit_rate of replay_ids at LRU_CAPACITY, the mean over REPLAY_DRAWS router draws."""
    return float(np.mean([hit_rate(replay_ids(inputs, n_expert, k, skew, seed * REPLAY_DRAWS + d), n_expert)
                          for d in range(REPLAY_DRAWS)]))


# ---- calibration -------------------------------------------------------------------------------------------------

def bisect(hit_at, target: float = LRU_TARGET, lo: float = 0.0, hi: float = 3.0, tol: float = TOLERANCE,
           steps: int = 14, log=print) -> tuple[float, float]:
    """The skew in [lo, hi] whose hit rate hit_at(skew) is within tol of target (hit rates rise with skew)."""
    h_lo, h_hi = hit_at(lo), hit_at(hi)
    log(f"  skew {lo:.4f}: {h_lo:.4f}\n  skew {hi:.4f}: {h_hi:.4f}")
    if not h_lo <= target <= h_hi:
        raise ValueError(f"the target {target} is outside [{h_lo:.3f}, {h_hi:.3f}] on skews [{lo}, {hi}]")
    best = (lo, h_lo) if abs(h_lo - target) < abs(h_hi - target) else (hi, h_hi)
    for _ in range(steps):
        mid = round((lo + hi) / 2, 4)
        h = hit_at(mid)
        log(f"  skew {mid:.4f}: {h:.4f}")
        if abs(h - target) < abs(best[1] - target):
            best = (mid, h)
        if abs(h - target) <= tol:
            break
        lo, hi = (mid, hi) if h < target else (lo, mid)
    return best


def made(preset: str, folder: str, seed: int, routing: str, skew: float | None = None) -> Path:
    path = Path(folder) / f"{preset}-{routing}-{seed}-{skew}.gguf"
    if not path.exists():
        make_model(preset, path, seed=seed, routing=routing, routing_skew=skew, log=lambda s: None)
    return path


# A proxy keeps a preset's width and depth (every dense tensor's shape) and shrinks what the router's input does
# not depend on: the expert count (the MoE output is still k random experts' mix), the vocabulary, the PLE table.
PROXY = {"n_expert": 16, "n_vocab": 4096, "eos_id": 4000, "ple_base": 20011}


def made_proxy(preset: str, folder: str, seed: int) -> Path:
    path = Path(folder) / f"{preset}-proxy-{seed}.gguf"
    if not path.exists():
        over = dict(PROXY, n_expert=max(PROXY["n_expert"], 2 * PRESETS[preset]["n_expert_used"]))
        make_model(preset, path, seed=seed, overrides=over, log=lambda s: None)
    return path


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}, numpy {np.__version__}"


def print_table(columns: dict[str, tuple[np.ndarray, int]], capacities=CAPACITIES, warmup: int = WARMUP) -> None:
    """LRU hit rate by capacity, one column per labelled (ids, n_expert)."""
    names = list(columns)
    print(f"| capacity (of each layer's experts) | {' | '.join(names)} |")
    print("|---|" + "---|" * len(names))
    for f in capacities:
        cells = []
        for name in names:
            ids, n = columns[name]
            cells.append(f"{hit_rate(ids, n, f, warmup):.1%}")
        slots = sorted({capacity_slots(f, n) for _, n in columns.values()})
        print(f"| {f:.0%} ({'/'.join(map(str, slots))} slots) | {' | '.join(cells)} |")
    print()
    print("| locality at 45% | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    stats = {name: locality(ids, n, LRU_CAPACITY, warmup) for name, (ids, n) in columns.items()}
    for key, what in (("lru", "LRU hit rate"), ("lru_shuffled", "LRU, tokens shuffled (skew only)"),
                      ("static_top", "static cache of the most used experts"),
                      ("consecutive_overlap", "experts shared by consecutive tokens"),
                      ("random_overlap", "experts shared by random token pairs")):
        print(f"| {what} | {' | '.join(f'{stats[n][key]:.1%}' for n in names)} |")
    print()


def note_uniform() -> None:
    print("uniform routing (random weights) spreads tokens almost evenly over the experts, so an LRU cache holding a "
          "fraction f of them hits little more than f: the worst case for an expert cache. Qwen3.8-Flash-Next's "
          f"published figure is {LRU_TARGET:.0%} at {LRU_CAPACITY:.0%}, the target of --routing realistic, whose "
          "locality is skew (popular experts): the shuffled row shows how little of it comes from token-to-token "
          "correlation, which random mixers barely carry.")


def cmd_report(a) -> int:
    columns = {}
    for path in a.files:
        t0 = time.time()
        model, ids = measure(path, a.tokens)
        routing = model.metadata.get("strata.routing", "not recorded")
        skew = model.metadata.get("strata.routing.skew")
        label = f"{Path(path).name} ({routing}{f', skew {skew:.3g}' if skew is not None else ''})"
        print(f"{path}: {model.cfg.n_layer} layers, {model.cfg.n_expert} experts top-{model.cfg.n_expert_used}, "
              f"{a.tokens} tokens, {time.time() - t0:.1f} s", file=sys.stderr)
        columns[label] = (ids, model.cfg.n_expert)
    print(f"# per-layer LRU hit rate, mean over layers: {a.tokens} tokens of English text, the first {WARMUP} "
          f"warming the caches")
    print_table(columns)
    note_uniform()
    return 0


def cmd_calibrate(a) -> int:
    preset, cfg = a.preset, PRESETS[a.preset]
    print(f"# calibrate --preset {preset} (seed {a.seed}, {a.tokens} tokens, target {a.target:.0%} at "
          f"{LRU_CAPACITY:.0%}); {machine()}; {time.strftime('%Y-%m-%d')}")
    with tempfile.TemporaryDirectory(dir=a.tmp) as tmp:
        if a.replay or a.proxy:
            src_path = a.replay or made_proxy(preset, tmp, a.seed)
            src = load_model(src_path)
            rec = record(src, a.tokens, keep_inputs=True)
            inputs = np.stack([np.concatenate(x) for x in rec.inputs])                      # (L, T, E)
            n, k = cfg["n_expert"], cfg["n_expert_used"]
            src_skew = src.metadata.get("strata.routing.skew", 0.0)
            own = replay_hit_rate(inputs, src.cfg.n_expert, src.cfg.n_expert_used, src_skew, a.seed)
            end_to_end = hit_rate(layer_ids(rec), src.cfg.n_expert)
            print(f"replay source {src_path}{' (the preset with ' + str(PROXY) + ')' if a.proxy else ''}: "
                  f"{src.cfg.n_layer} layers, hidden {src.cfg.n_embd}, "
                  f"{src.cfg.n_expert} experts top-{src.cfg.n_expert_used}, skew {src_skew:.3g}")
            print(f"  check: its own geometry replayed {own:.1%} (mean of {REPLAY_DRAWS} router draws) vs measured "
                  f"end to end {end_to_end:.1%}")
            print(f"bisecting for {n} experts top-{k} ({capacity_slots(LRU_CAPACITY, n)} slots):")

            def hit_at(skew: float) -> float:
                return replay_hit_rate(inputs, n, k, skew, a.seed)
            skew, hit = bisect(hit_at, a.target)
            uniform = hit_at(0.0)
            columns = {"uniform (replay, one draw)": (replay_ids(inputs, n, k, 0.0, a.seed), n),
                       f"realistic, skew {skew:g} (replay, one draw)": (replay_ids(inputs, n, k, skew, a.seed), n)}
        else:
            print("bisecting, end to end on the reference model:")
            n = cfg["n_expert"]
            measured: dict[float, np.ndarray] = {}

            def ids_at(routing: str, skew: float | None, seed: int) -> np.ndarray:
                path = made(preset, tmp, seed, routing, skew)
                ids = measure(path, a.tokens)[1]
                path.unlink()                               # a medium file is 1.15 GiB
                return ids

            def hit_at(skew: float) -> float:
                measured[skew] = ids_at("realistic", skew, a.seed)
                return hit_rate(measured[skew], n)
            skew, hit = bisect(hit_at, a.target)
            uniform_ids = ids_at("uniform", None, a.seed)
            uniform = hit_rate(uniform_ids, n)
            columns = {"uniform": (uniform_ids, n), f"realistic, skew {skew:g}": (measured[skew], n)}
            for s in a.check_seeds:
                print(f"  seed {s} at skew {skew:g}: {hit_rate(ids_at('realistic', skew, s), n):.1%}")
        print(f"\ncalibrated: --preset {preset} skew {skew:g} -> LRU hit rate {hit:.1%} at {LRU_CAPACITY:.0%} "
              f"(uniform: {uniform:.1%}); make-model's default is {ROUTING_SKEW.get(preset, 'none')}\n")
        print_table(columns)
    note_uniform()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report", help="LRU hit rate by capacity for each file")
    r.add_argument("files", nargs="+")
    r.add_argument("--tokens", type=int, default=TOKENS)
    r.set_defaults(fn=cmd_report)
    c = sub.add_parser("calibrate", help="bisect --routing realistic's skew for a preset")
    c.add_argument("--preset", required=True, choices=list(PRESETS))
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--tokens", type=int, default=TOKENS)
    c.add_argument("--target", type=float, default=LRU_TARGET)
    c.add_argument("--replay", metavar="FILE", help="route FILE's recorded router inputs through the preset's "
                                                    "router geometry instead of running the preset")
    c.add_argument("--proxy", action="store_true",
                   help="replay the router inputs of a proxy: the preset's width and depth with 16 experts, a 4096 "
                        "vocabulary and a small PLE table (a preset too large to run: flash)")
    c.add_argument("--check-seeds", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
                   help="also measure these seeds at the calibrated skew (end to end only)")
    c.add_argument("--tmp", default=None, help="folder for the made files (default: the system's)")
    c.set_defaults(fn=cmd_calibrate)
    a = p.parse_args(argv)
    if a.tokens <= WARMUP:
        p.error(f"--tokens must be more than the {WARMUP} warm-up tokens")
    try:
        return a.fn(a)
    except ValueError as e:                 # a target out of reach, a bad file: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
