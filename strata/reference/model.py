"""The numpy reference forward, organized by the engine's stages, over a step of T tokens.

A step is a flat list of rows: runs of consecutive tokens of one sequence each (a prompt chunk, or one decoding
token), in any mix. Matrix work spans all T rows; the sequence-stateful parts (GDN conv and recurrence, the QSA
cache, the PLE conv history) run per run of rows, token by token inside. A single token is the step of one row,
so there is one model definition. Per layer l:
    pre[l]  = [PLE, on its layer] -> gr_read(attn) -> mixer (GDN | QSA) -> gr_write(attn) -> gr_read(ffn) -> route
    (the routed experts: whoever computes them, CPU pool or VRAM cache, grouped by expert)
    post[l] = combine (shared expert + weighted experts) -> gr_write(ffn)
Every backend and the scheduler reuse these boundaries, and `StageDump` records them (the C1 oracle).
T = rows in the step, k = experts per token, E = hidden size, hc = residual streams.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from strata.config import ModelConfig
from strata.model.weights import Weights
from strata.reference.common import F32, rope_inv_freq, table_rows
from strata.reference.gdn import GdnState, gdn_chunk
from strata.reference.hc import gr_read, gr_write
from strata.reference.moe import combine, route, routed_experts, shared_expert
from strata.reference.ple import NgramWindow, PleState, ple_block, ple_gather, ple_rows
from strata.reference.qsa import QsaState, qsa_chunk

# the stage names, in order, that a dump records per layer
STAGES = ("ple", "attn_read", "mixer", "attn_write", "ffn_read", "route", "experts", "combine", "ffn_write")


@dataclass
class StageDump:
    """C1 oracle: {(pos, layer, stage): array}; layer -1 holds the embedding and the logits."""
    data: dict = field(default_factory=dict)

    def put(self, pos: int, layer: int, stage: str, value: np.ndarray) -> None:
        self.data[(pos, layer, stage)] = np.array(value, dtype=np.float32, copy=True)

    def save(self, path: str) -> None:
        np.savez_compressed(path, **{f"{p}/{l}/{s}": v for (p, l, s), v in self.data.items()})

    @classmethod
    def load(cls, path: str) -> "StageDump":
        with np.load(path) as z:
            return cls({(int(k.split("/")[0]), int(k.split("/")[1]), k.split("/")[2]): z[k] for k in z.files})


def stage_order(key: tuple[int, int, str]) -> tuple:
    pos, layer, stage = key
    rank = {"embed": -1, "logits": len(STAGES)}.get(stage, STAGES.index(stage) if stage in STAGES else 99)
    return (pos, layer if stage != "logits" else 10**9, rank)


def first_divergence(a: StageDump, b: StageDump, rtol: float = 1e-4) -> tuple | None:
    """The first (pos, layer, stage) in forward order where a and b differ by more than rtol (max-abs relative)."""
    for key in sorted(set(a.data) & set(b.data), key=stage_order):
        x, y = a.data[key], b.data[key]
        scale = max(float(np.max(np.abs(y))), 1e-30)
        if x.shape != y.shape or float(np.max(np.abs(x - y))) / scale > rtol:
            return key
    return None


@dataclass
class SeqState:
    """The full decode state of one sequence."""
    pos: int
    gdn: dict[int, GdnState]
    qsa: dict[int, QsaState]
    ple: PleState | None
    window: NgramWindow | None
    dump: StageDump | None = None


@dataclass(frozen=True)
class Batch:
    """One step as the reference runs it: runs of rows, each (its sequence's state, first row, row count)."""
    tokens: np.ndarray                               # (T,) int64
    pos: np.ndarray                                  # (T,) int64: each row's position in its sequence
    runs: tuple[tuple[SeqState, int, int], ...]
    dumping: bool = False                            # some run's state records a StageDump

    @classmethod
    def of(cls, runs: list[tuple[SeqState, list[int]]]) -> "Batch":
        """[(state, tokens)] -> the batch, each run at its state's next positions."""
        out, toks, pos, at = [], [], [], 0
        for st, tokens in runs:
            if len(tokens) == 0:
                raise ValueError("a run of a step has no tokens")
            out.append((st, at, len(tokens)))
            toks += list(tokens)
            pos.append(np.arange(st.pos, st.pos + len(tokens)))
            at += len(tokens)
        return cls(np.array(toks, np.int64), np.concatenate(pos).astype(np.int64), tuple(out),
                   any(st.dump is not None for st, _ in runs))

    @property
    def T(self) -> int:
        return len(self.tokens)


@dataclass
class PreOut:
    """What `pre[l]` hands to the expert work and to `post[l]`."""
    R: np.ndarray          # (T, hc, E) streams after the attention half
    x: np.ndarray          # (T, E) the MoE input (ffn gr_read's mixed)
    inject: np.ndarray     # (T, hc) the ffn half's inject weights
    ids: np.ndarray        # (T, k) routed experts
    weights: np.ndarray    # (T, k) their renormalized weights


class RefModel:
    """The reference engine over mapped weights. Stateless itself: all sequence state lives in SeqState."""

    def __init__(self, weights: Weights):
        self.w = weights
        self.cfg: ModelConfig = weights.cfg
        self.inv_freq = rope_inv_freq(self.cfg.n_rot, self.cfg.rope_base)

    def new_state(self, dump: StageDump | None = None) -> SeqState:
        cfg = self.cfg
        return SeqState(
            pos=0,
            gdn={il: GdnState.zeros(cfg) for il in range(cfg.n_layer) if cfg.recurrent[il]},
            qsa={il: QsaState.empty(cfg) for il in range(cfg.n_layer) if not cfg.recurrent[il]},
            ple=PleState.start(cfg) if cfg.ple_layers else None,
            window=NgramWindow.start(cfg) if cfg.ple_layers else None,
            dump=dump,
        )

    @staticmethod
    def _put(b: Batch, layer: int, stage: str, v: np.ndarray, rows=None) -> None:
        """Dump v's rows (one per step row; `rows` the step rows v's rows belong to) at their positions."""
        if not b.dumping:
            return
        for st, a, n in b.runs:
            if st.dump is None:
                continue
            for i in range(a, a + n):
                if rows is None:
                    st.dump.put(int(b.pos[i]), layer, stage, v[i])
                elif i in rows:
                    st.dump.put(int(b.pos[i]), layer, stage, v[rows.index(i)])

    # the stages ------------------------------------------------------------------------------------------------
    def embed(self, b: Batch) -> np.ndarray:
        """Every stream starts as the token's embedding row: R (T, hc, E)."""
        bad = (b.tokens < 0) | (b.tokens >= self.cfg.n_vocab)
        if bad.any():
            raise ValueError(f"token id {int(b.tokens[bad][0])} is outside the vocabulary [0, {self.cfg.n_vocab})")
        e = table_rows(self.w.token_embd, b.tokens)                                     # (T, E)
        self._put(b, -1, "embed", e)
        return np.repeat(e[:, None, :], self.cfg.hc, axis=1)

    def ple_input(self, b: Batch) -> np.ndarray:
        """The gathered PLE rows (T, ple_dim), from each run's n-gram window (host work: hash + table reads)."""
        rows = np.concatenate([ple_rows(self.cfg, b.tokens[a:a + n], st.window) for st, a, n in b.runs])
        return ple_gather(self.w.per_layer_token_embd, rows)

    def pre(self, b: Batch, il: int, R: np.ndarray, ple_e: np.ndarray | None = None) -> PreOut:
        cfg, w = self.cfg, self.w.layers[il]
        if il in cfg.ple_layers:
            R = ple_block(cfg, w, [(st.ple, a, n) for st, a, n in b.runs], R, ple_e)
            self._put(b, il, "ple", R)
        x, inj = gr_read(R, w.hc_attn_norm, w.hc_attn_down, w.hc_attn_up, w.hc_attn_inject, cfg.rms_eps)
        self._put(b, il, "attn_read", x)
        if cfg.recurrent[il]:
            out = gdn_chunk(cfg, w, [(st.gdn[il], a, n) for st, a, n in b.runs], x)
        else:
            out = qsa_chunk(cfg, il, w, [(st.qsa[il], a, n) for st, a, n in b.runs], x, b.pos, self.inv_freq)
        self._put(b, il, "mixer", out)
        R = gr_write(R, inj, out)
        self._put(b, il, "attn_write", R)
        x, inj = gr_read(R, w.hc_ffn_norm, w.hc_ffn_down, w.hc_ffn_up, w.hc_ffn_inject, cfg.rms_eps)
        self._put(b, il, "ffn_read", x)
        ids, wts = route(cfg, w, x)
        self._put(b, il, "route", wts)
        return PreOut(R, x, inj, ids, wts)

    def experts(self, il: int, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The routed experts' outputs (T, k, E) in the order of ids (T, k), each expert once over its rows."""
        return routed_experts(self.w.layers[il], x, ids)

    def post(self, b: Batch, il: int, p: PreOut, parts: np.ndarray) -> np.ndarray:
        w = self.w.layers[il]
        self._put(b, il, "experts", parts)
        out = combine(p.weights, parts, shared_expert(w, p.x))
        self._put(b, il, "combine", out)
        R = gr_write(p.R, p.inject, out)
        self._put(b, il, "ffn_write", R)
        return R

    def head(self, b: Batch, R: np.ndarray, rows: list[int]) -> np.ndarray:
        """Logits (len(rows), n_vocab) of the given step rows only."""
        w = self.w
        x, _ = gr_read(R[rows], w.output_hc_norm, w.output_hc_down, w.output_hc_up, None, self.cfg.rms_eps)
        logits = (w.output @ x).astype(F32)
        self._put(b, -1, "logits", logits, rows)
        return logits

    def finish(self, b: Batch) -> None:
        """Every run's sequence has been fed its rows: positions and n-gram windows move on."""
        for st, a, n in b.runs:
            if st.window is not None:
                st.window.advance_all(self.cfg, b.tokens[a:a + n])
            st.pos += n

    # whole steps ------------------------------------------------------------------------------------------------
    def forward(self, b: Batch, rows: list[int]) -> np.ndarray:
        """Run the step; the logits (len(rows), n_vocab) of the given rows."""
        R = self.embed(b)
        ple_e = self.ple_input(b) if self.cfg.ple_layers else None
        for il in range(self.cfg.n_layer):
            p = self.pre(b, il, R, ple_e if il in self.cfg.ple_layers else None)
            R = self.post(b, il, p, self.experts(il, p.x, p.ids))
        logits = self.head(b, R, rows)
        self.finish(b)
        return logits

    def step(self, st: SeqState, token: int) -> np.ndarray:
        """Feed `token` at position st.pos; returns its logits (n_vocab,)."""
        return self.forward(Batch.of([(st, [token])]), [0])[0]

    def chunk(self, st: SeqState, tokens: list[int]) -> np.ndarray:
        """Feed a run of tokens at st.pos.. in one step; every row's logits (n, n_vocab)."""
        return self.forward(Batch.of([(st, tokens)]), list(range(len(tokens))))
