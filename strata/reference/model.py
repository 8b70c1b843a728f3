"""The numpy reference forward, one token at a time, organized by the engine's stages.

Per layer l:
    pre[l]  = [PLE, on its layer] -> gr_read(attn) -> mixer (GDN | QSA) -> gr_write(attn) -> gr_read(ffn) -> route
    (the routed experts: whoever computes them, CPU pool or VRAM cache)
    post[l] = combine (shared expert + weighted experts) -> gr_write(ffn)
Every backend and the scheduler reuse these boundaries, and `StageDump` records them (the C1 oracle).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from strata.config import ModelConfig
from strata.model.weights import Weights
from strata.reference.common import F32, rope_inv_freq
from strata.reference.gdn import GdnState, gdn_step
from strata.reference.hc import gr_read, gr_write
from strata.reference.moe import combine, expert_ffn, route, shared_expert
from strata.reference.ple import NgramWindow, PleState, ple_block, ple_gather, ple_rows
from strata.reference.qsa import QsaState, qsa_step

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


@dataclass
class PreOut:
    """What `pre[l]` hands to the expert work and to `post[l]`."""
    R: np.ndarray          # (hc, E) streams after the attention half
    x: np.ndarray          # (E,) the MoE input (ffn gr_read's mixed)
    inject: np.ndarray     # (hc,) the ffn half's inject weights
    ids: np.ndarray        # (k,) routed experts
    weights: np.ndarray    # (k,) their renormalized weights


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

    def _put(self, st: SeqState, layer: int, stage: str, v: np.ndarray) -> None:
        if st.dump is not None:
            st.dump.put(st.pos, layer, stage, v)

    # the stages ------------------------------------------------------------------------------------------------
    def embed(self, st: SeqState, token: int) -> np.ndarray:
        """Every stream starts as the token's embedding row: R (hc, E)."""
        if not 0 <= token < self.cfg.n_vocab:
            raise ValueError(f"token id {token} is outside the vocabulary [0, {self.cfg.n_vocab})")
        e = self.w.token_embd.row(token)
        self._put(st, -1, "embed", e)
        return np.repeat(e[None, :], self.cfg.hc, axis=0).astype(F32)

    def ple_input(self, st: SeqState, token: int) -> np.ndarray:
        """The gathered PLE rows for this token (host work: hash + table reads)."""
        return ple_gather(self.w.per_layer_token_embd, ple_rows(self.cfg, token, st.window.prev))

    def pre(self, st: SeqState, il: int, R: np.ndarray, ple_e: np.ndarray | None = None) -> PreOut:
        cfg, w = self.cfg, self.w.layers[il]
        if il in cfg.ple_layers:
            R = ple_block(cfg, w, st.ple, R, ple_e)
            self._put(st, il, "ple", R)
        x, inj = gr_read(R, w.hc_attn_norm, w.hc_attn_down, w.hc_attn_up, w.hc_attn_inject, cfg.rms_eps)
        self._put(st, il, "attn_read", x)
        if cfg.recurrent[il]:
            out = gdn_step(cfg, w, st.gdn[il], x)
        else:
            out, _ = qsa_step(cfg, il, w, st.qsa[il], x, st.pos, self.inv_freq)
        self._put(st, il, "mixer", out)
        R = gr_write(R, inj, out)
        self._put(st, il, "attn_write", R)
        x, inj = gr_read(R, w.hc_ffn_norm, w.hc_ffn_down, w.hc_ffn_up, w.hc_ffn_inject, cfg.rms_eps)
        self._put(st, il, "ffn_read", x)
        ids, wts = route(cfg, w, x)
        self._put(st, il, "route", wts)
        return PreOut(R, x, inj, ids, wts)

    def experts(self, il: int, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """The routed experts' outputs (k, E), in the order of ids."""
        w = self.w.layers[il]
        return np.stack([expert_ffn(*w.expert(int(e)), x) for e in ids]).astype(F32)

    def post(self, st: SeqState, il: int, p: PreOut, parts: np.ndarray) -> np.ndarray:
        w = self.w.layers[il]
        self._put(st, il, "experts", parts)
        out = combine(p.weights, parts, shared_expert(w, p.x))
        self._put(st, il, "combine", out)
        R = gr_write(p.R, p.inject, out)
        self._put(st, il, "ffn_write", R)
        return R

    def head(self, st: SeqState, R: np.ndarray) -> np.ndarray:
        w = self.w
        x, _ = gr_read(R, w.output_hc_norm, w.output_hc_down, w.output_hc_up, None, self.cfg.rms_eps)
        logits = (w.output @ x).astype(F32)
        self._put(st, -1, "logits", logits)
        return logits

    def finish_token(self, st: SeqState, token: int) -> None:
        if st.window is not None:
            st.window.advance(self.cfg, token)
        st.pos += 1

    # one whole token --------------------------------------------------------------------------------------------
    def step(self, st: SeqState, token: int) -> np.ndarray:
        """Feed `token` at position st.pos; returns its logits (n_vocab,)."""
        R = self.embed(st, token)
        ple_e = self.ple_input(st, token) if st.ple is not None else None
        for il in range(self.cfg.n_layer):
            p = self.pre(st, il, R, ple_e if il in self.cfg.ple_layers else None)
            R = self.post(st, il, p, self.experts(il, p.x, p.ids))
        logits = self.head(st, R)
        self.finish_token(st, token)
        return logits
