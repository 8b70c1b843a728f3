"""Peak memory of `cli.py convert` on a synthetic bf16 checkpoint of a few GB, against the converter's bound:
1.5x the largest tensor's bf16 bytes plus a fixed overhead; and of `cli.py quantize` on the GGUF it wrote.

    python bench/bench_convert.py [--dir /tmp/strata-bench-convert] [--layout per-expert|fused] [--keep]
    python bench/bench_convert.py --write tiny|big [--dir DIR]     # only write DIR/tiny (12 MB) or DIR/big

1. Writes DIR/big/: a transformers Qwen4-Exp checkpoint (tensor names and shapes from Qwen4ExpForCausalLM built on
   torch's meta device, so nothing is allocated; experts per expert as save_pretrained writes them, or --layout
   fused, the runtime gate_up_proj/down_proj), random bf16 values, two shards, written chunk by chunk. BIG: hidden
   2048, vocab 196,608 (embedding and LM head 768 MiB each), 4 layers (3 GDN with retiled value heads, 1 QSA), 64
   experts of 512, PLE on layer 1: 3.3 GiB. DIR/tiny/: the same layout at a tiny geometry (10 MB).
2. Converts each in a child process, `python cli.py convert DIR OUT` with each of RUNS' options, then runs
   `python cli.py quantize` on the bf16 GGUFs to the realistic mix, and reads each child's peak RSS two ways:
   os.wait4's rusage (ru_maxrss: resident pages, file-backed mapped pages included, which is why the converter
   gives mapped pages back after each chunk) and VmHWM polled from /proc every 20 ms. Linux keeps ru_maxrss
   across exec, so a child starts from its parent's peak: this process imports nothing heavy (the checkpoints
   are written by a child of their own, which needs torch) and prints its own peak.
3. Prints, per run: the checkpoint's bytes, the largest tensor's bf16 bytes, the fixed overhead (the peak of the
   same conversion of the tiny checkpoint: interpreter, numpy, numba and the quantizers it loads, one chunk's
   buffers), the big conversion's peak, the bound 1.5 x largest + overhead, and the wall time. What the big run
   adds to the overhead is its 196,608-token vocabulary (no tokenizer.json: the synthetic one, ~20 MB) and
   full-size chunks on every worker thread; none of it grows with the tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = [["--outtype", "bf16"], ["--outtype", "q8_0"], ["--mix", "realistic"]]     # the first must be bf16
BIG = dict(hidden=2048, layers=4, heads=16, kv_heads=2, head_dim=128, k_heads=8, v_heads=16, lin_dim=128,
           experts=64, top_k=8, ff=512, ff_shared=512, rank=128, idx_heads=4, idx_dim=128, budget=2048,
           vocab=196_608, eos=196_000, heads_per_ngram=8, ngram_base=20_011, mrope=[6, 5, 5])
# rows of 256 like BIG's, so the tiny run loads and runs the same quantizers (K-quants, IQ4_XS) as the big one
TINY = dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, k_heads=2, v_heads=4, lin_dim=64, experts=4,
            top_k=2, ff=256, ff_shared=256, rank=16, idx_heads=2, idx_dim=64, budget=16, vocab=1024, eos=1000,
            heads_per_ngram=2, ngram_base=101, mrope=[3, 3, 2])
SHARD_BYTES = 2 << 30
CHUNK = 64 << 20            # bytes of random bf16 generated at a time


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def hf_config(g: dict):
    from transformers import Qwen4ExpTextConfig
    return Qwen4ExpTextConfig(
        vocab_size=g["vocab"], hidden_size=g["hidden"], num_hidden_layers=g["layers"],
        num_attention_heads=g["heads"], num_key_value_heads=g["kv_heads"], head_dim=g["head_dim"],
        linear_num_key_heads=g["k_heads"], linear_num_value_heads=g["v_heads"], linear_key_head_dim=g["lin_dim"],
        linear_value_head_dim=g["lin_dim"], moe_intermediate_size=g["ff"],
        shared_expert_intermediate_size=g["ff_shared"], num_experts=g["experts"], num_experts_per_tok=g["top_k"],
        hc_count=4, hc_lowrank=g["rank"], ple_layer_ids=[2], ngram_vocab_size_base=g["ngram_base"],
        heads_per_ngram=g["heads_per_ngram"], ngram_size=3, indexer_n_heads=g["idx_heads"], indexer_kv_heads=1,
        indexer_head_dim=g["idx_dim"], indexer_budget=g["budget"], indexer_compress_ratio=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": g["mrope"], "mrope_interleaved": True},
        eos_token_id=g["eos"], output_gate_type="sigmoid", rms_norm_eps=1e-6, tie_word_embeddings=False)


def layout(cfg, per_expert: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every float tensor of the checkpoint, from the model built on the meta device."""
    import torch
    from transformers import Qwen4ExpForCausalLM
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(cfg)
    out = []
    for name, t in model.state_dict().items():
        if not t.is_floating_point():
            continue                              # the PLE hash constants: the converter derives them
        if per_expert and name.endswith("experts.gate_up_proj"):
            n, two_f, E = t.shape
            stem = name.removesuffix("gate_up_proj")
            for e in range(n):
                out += [(f"{stem}{e}.{k}_proj.weight", (two_f // 2, E)) for k in ("gate", "up")]
        elif per_expert and name.endswith("experts.down_proj"):
            n, E, F = t.shape
            stem = name.removesuffix("down_proj")
            out += [(f"{stem}{e}.down_proj.weight", (E, F)) for e in range(n)]
        else:
            out.append((name, tuple(t.shape)))
    return out


def write_checkpoint(folder: Path, g: dict, per_expert: bool, seed: int = 0) -> tuple[int, str, int]:
    """The checkpoint in shards of at most SHARD_BYTES, values random bf16 of magnitude ~0.01, written a chunk at
    a time. Returns (its bytes, the largest tensor's name and bytes)."""
    import numpy as np
    folder.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(g)
    cfg.save_pretrained(folder)
    tensors = layout(cfg, per_expert)
    shards, cur, size = [], [], 0
    for name, shape in tensors:
        nbytes = int(_prod(shape)) * 2
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += nbytes
    shards.append(cur)
    rng = np.random.default_rng(seed)
    total = 0
    for k, shard in enumerate(shards):
        header, off = {}, 0
        for name, shape in shard:
            n = int(_prod(shape)) * 2
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors", "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for name, shape in shard:
                left = int(_prod(shape))
                while left:
                    n = min(left, CHUNK // 2)
                    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
                    f.write(((bits & 0x807F) | 0x3C00).astype("<u2").tobytes())     # +-[2^-7, 2^-6)
                    left -= n
        total += 8 + len(raw) + off
    largest = max(tensors, key=lambda t: _prod(t[1]))
    return total, largest[0], int(_prod(largest[1])) * 2


def peak_rss(cmd: list[str], log: Path) -> tuple[int, int, float, str]:
    """(ru_maxrss bytes, polled VmHWM bytes, wall seconds, last output line) of a child process."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    hwm = 0
    while True:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        try:
            with open(f"/proc/{p.pid}/status") as f:
                hwm = max([hwm] + [int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:")])
        except OSError:
            pass
        time.sleep(0.02)
    p.returncode = os.waitstatus_to_exitcode(status)        # reaped here: Popen must not wait again
    wall = time.perf_counter() - t0
    out = log.read_text().strip()
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}): {out[-2000:]}")
    return usage.ru_maxrss * 1024, hwm, wall, out.splitlines()[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/strata-bench-convert", help="where the checkpoints and GGUFs go")
    ap.add_argument("--layout", default="per-expert", choices=["per-expert", "fused"])
    ap.add_argument("--keep", action="store_true", help="keep the files (default: removed at the end)")
    ap.add_argument("--write", choices=["big", "tiny"],
                    help="only write that checkpoint, as DIR/big or DIR/tiny (the bench runs itself so)")
    a = ap.parse_args()
    root = Path(a.dir)
    if a.write:
        root.mkdir(parents=True, exist_ok=True)
        print(json.dumps(write_checkpoint(root / a.write, BIG if a.write == "big" else TINY,
                                          a.layout == "per-expert")))
        return
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    made = {}
    for which in ("big", "tiny"):
        r = subprocess.run([sys.executable, __file__, "--dir", str(root), "--layout", a.layout, "--write", which],
                           capture_output=True, text=True, check=True)
        made[which] = json.loads(r.stdout.strip().splitlines()[-1])
    size, big_name, big_bytes = made["big"]
    print(f"# bench_convert: {platform.node()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}, layout "
          f"{a.layout}")
    print(f"checkpoint {size / 2**30:.2f} GiB bf16 (written in {time.perf_counter() - t0:.0f} s); largest tensor "
          f"{big_name} {big_bytes / 2**20:.0f} MiB; tiny checkpoint {made['tiny'][0] / 2**20:.1f} MiB")
    print("| command | tiny: peak RSS = overhead | big: peak RSS (VmHWM) | bound 1.5 x largest + overhead | "
          "peak - overhead | wall | GGUF |")
    print("|---|---|---|---|---|---|---|")
    mib = 2**20
    cli = [sys.executable, str(ROOT / "cli.py")]
    runs = [[["convert", str(root / w), str(root / f"{w}.gguf"), *opts] for w in ("tiny", "big")] for opts in RUNS]
    # then `quantize` of the bf16 GGUFs the first run wrote, to the realistic mix
    runs.append([["quantize", str(root / f"{w}-bf16.gguf"), str(root / f"{w}.gguf"), "--mix", "realistic"]
                 for w in ("tiny", "big")])
    for k, (tiny, big) in enumerate(runs):
        over, _, _, _ = peak_rss([*cli, *tiny], root / "tiny.log")
        peak, hwm, wall, _ = peak_rss([*cli, *big], root / "big.log")
        bound = 1.5 * big_bytes + over
        gguf = (root / "big.gguf").stat().st_size
        what = " ".join([big[0], *big[3:]]) + (" (the bf16 GGUF)" if big[0] == "quantize" else "")
        print(f"| {what} | {over / mib:.0f} MiB | {peak / mib:.0f} MiB ({hwm / mib:.0f}) | "
              f"{bound / mib:.0f} MiB ({'within' if peak <= bound else 'OVER'}) | {(peak - over) / mib:.0f} MiB | "
              f"{wall:.1f} s | {gguf / 2**30:.2f} GiB |", flush=True)
        if k == 0:
            for w in ("tiny", "big"):
                (root / f"{w}.gguf").rename(root / f"{w}-bf16.gguf")
        else:
            (root / "big.gguf").unlink()
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"this process's own peak RSS (the floor of every child's ru_maxrss): {own:.0f} MiB")
    if not a.keep:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
