"""The model's weights as views of the mapped GGUF: quantized matrices stay quantized, vectors load as float32.

Attribute names are the GGUF tensor names (`blk.N.ssm_alpha.weight` -> `layers[N].ssm_alpha`), so the math in
`strata.reference` reads like the checkpoint. Every tensor's type and shape is checked against ModelConfig here,
once; nothing downstream re-checks. The type check is what the CPU kernels run on that tensor: a matrix type
without a kernel (Q8_1, Q8_K: llama.cpp's activation formats) fails here, naming the tensor, not at the first
token. A Mat over the mapping checks the file is unchanged before each use (see strata.model.gguf_file.FileGuard).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from strata.config import ModelConfig
from strata.model.gguf_file import FileGuard, GGUFError, GGUFFile, TensorInfo
from strata.model.schema import FLOAT_TYPES, Spec, all_specs
from strata.quant import QType, dequantize, dequantize_rows
from strata.quant.matmul import matmul
from strata.quant.matvec import _KERNELS as _MATVEC_KERNELS

# what strata.quant.matmul runs (the float types, and every type with a quantized matvec kernel)
MATRIX_TYPES = tuple(t.name for t in QType if t.name in FLOAT_TYPES or t in _MATVEC_KERNELS)


class Mat:
    """A weight matrix W (n_out, n_in) in its file format; `w @ x` runs the quantized matvec on its blocks.

    A 3-D tensor (experts) is `n_mat` stacked matrices; `mat[e]` is expert e's contiguous slice.
    """

    def __init__(self, name: str, qtype: QType, raw: np.ndarray, n_out: int, n_in: int, n_mat: int = 1,
                 exact: bool = False, guard: FileGuard | None = None):
        self.name, self.qtype, self.n_out, self.n_in, self.n_mat = name, qtype, n_out, n_in, n_mat
        self.raw = raw                      # (n_mat * n_out, row_bytes) uint8, or (rows, n_in) f32 for F32
        self.exact = exact
        self.guard = guard                  # the mapped file's, when raw is a view of it

    @classmethod
    def from_tensor(cls, t: TensorInfo, exact: bool) -> "Mat":
        n_in = t.shape[0]
        n_out = t.shape[1] if len(t.shape) > 1 else 1
        n_mat = int(np.prod(t.shape[2:], dtype=np.int64)) if len(t.shape) > 2 else 1
        raw = t.rows()
        if t.qtype == QType.F32:
            raw = raw.view(np.float32)      # BLAS straight from the mapping
        return cls(t.name, t.qtype, raw, n_out, n_in, n_mat, exact, t.guard)

    def __getitem__(self, e: int) -> "Mat":
        if not 0 <= e < self.n_mat:
            raise IndexError(f"{self.name}: matrix {e} of {self.n_mat}")
        return Mat(f"{self.name}[{e}]", self.qtype, self.raw[e * self.n_out:(e + 1) * self.n_out],
                   self.n_out, self.n_in, 1, self.exact, self.guard)

    def rows_slice(self, start: int, stop: int) -> "Mat":
        """Rows [start, stop) as a matrix of their own (a fused gate|up split)."""
        return Mat(f"{self.name}[{start}:{stop}]", self.qtype, self.raw[start:stop], stop - start, self.n_in, 1,
                   self.exact, self.guard)

    def _check(self) -> None:
        # ~1.5 us of fstat against a matmul's tens of us and up: a truncated file is an OSError, not SIGBUS
        if self.guard is not None:
            self.guard.check()

    def __matmul__(self, x: np.ndarray) -> np.ndarray:
        """W x for x (n_in,) -> (n_out,), or every row of x (T, n_in) -> (T, n_out). Row t of a batch is bit for bit
        what that row alone gives (the per-row kernels of strata.quant, F32 included: no BLAS, whose blocking
        would make a row's rounding depend on T), so a batched step equals the token-by-token one."""
        self._check()
        if x.ndim == 1:
            return matmul(self.raw, self.qtype, x[None, :], exact=self.exact)[0]
        return matmul(self.raw, self.qtype, x, exact=self.exact)

    def row(self, i: int) -> np.ndarray:
        """One row dequantized (an embedding lookup), without touching the rest of the table."""
        self._check()
        return dequantize_rows(self.raw if self.qtype != QType.F32 else self.raw.view(np.uint8), self.qtype,
                               np.array([i]))[0]

    def dense(self) -> np.ndarray:
        """The whole matrix as float32 (tests and tiny models only)."""
        self._check()
        raw = self.raw.view(np.uint8) if self.qtype == QType.F32 else self.raw
        return dequantize(raw, self.qtype).reshape(self.n_mat * self.n_out, self.n_in)


def _vector(t: TensorInfo) -> np.ndarray:
    return np.ascontiguousarray(dequantize(t.data, t.qtype).reshape(t.np_shape), dtype=np.float32)


@dataclass
class LayerWeights:
    il: int
    kind: str                                   # "gdn" or "qsa"
    hc_attn_norm: np.ndarray = None             # (hc, E) gamma, stored as (1 + w)
    hc_attn_down: Mat = None                    # (r, hc*E)
    hc_attn_up: Mat = None                      # (hc*E, r)
    hc_attn_inject: Mat = None                  # (hc, hc*E)
    hc_ffn_norm: np.ndarray = None
    hc_ffn_down: Mat = None
    hc_ffn_up: Mat = None
    hc_ffn_inject: Mat = None
    # GDN
    attn_qkv: Mat = None                        # (2*kd + vd, E)
    attn_gate: Mat = None                       # (vd, E)
    ssm_conv1d: np.ndarray = None               # (conv_dim, K)
    ssm_dt: np.ndarray = None                   # (Hv,) the dt bias
    ssm_a: np.ndarray = None                    # (Hv,) = -exp(A_log)
    ssm_alpha: Mat = None                       # (Hv, E)
    ssm_beta: Mat = None                        # (Hv, E)
    ssm_norm: np.ndarray = None                 # (Dv,) stored as is
    ssm_out: Mat = None                         # (E, vd)
    # QSA
    attn_q: Mat = None                          # (2*H*D, E): per head [q | gate]
    attn_k: Mat = None                          # (Hkv*D, E)
    attn_v: Mat = None                          # (Hkv*D, E)
    attn_output: Mat = None                     # (E, H*D)
    attn_q_norm: np.ndarray = None              # (D,)
    attn_k_norm: np.ndarray = None              # (D,)
    indexer_q_proj: Mat = None                  # (Hi*Di, E)
    indexer_k_proj: Mat = None                  # (Di, E)
    indexer_q_norm: np.ndarray = None           # (Di,)
    indexer_k_norm: np.ndarray = None           # (Di,)
    # PLE (one layer)
    ple_key: Mat = None                         # (hc*E, ple_dim)
    ple_value: Mat = None                       # (E, ple_dim)
    ple_norm_key: np.ndarray = None             # (hc, E)
    ple_norm_query: np.ndarray = None           # (hc, E)
    ple_norm_conv: np.ndarray = None            # (hc, E)
    ple_conv1d: np.ndarray = None               # (hc*E, K)
    # MoE
    ffn_gate_inp: Mat = None                    # (n_exp, E) the router
    ffn_gate_exps: Mat = None                   # n_exp x (F, E)
    ffn_up_exps: Mat = None                     # n_exp x (F, E)
    ffn_gate_up_exps: Mat = None                # n_exp x (2F, E), when the file fuses the pair
    ffn_down_exps: Mat = None                   # n_exp x (E, F)
    ffn_gate_inp_shexp: np.ndarray = None       # (E,)
    ffn_gate_shexp: Mat = None                  # (Fs, E)
    ffn_up_shexp: Mat = None                    # (Fs, E)
    ffn_down_shexp: Mat = None                  # (E, Fs)

    def expert(self, e: int) -> tuple[Mat, Mat, Mat]:
        """(gate, up, down) of expert e: each a contiguous slice of its stacked tensor."""
        if self.ffn_gate_up_exps is not None:
            gu = self.ffn_gate_up_exps[e]
            half = gu.n_out // 2
            return gu.rows_slice(0, half), gu.rows_slice(half, gu.n_out), self.ffn_down_exps[e]
        return self.ffn_gate_exps[e], self.ffn_up_exps[e], self.ffn_down_exps[e]


@dataclass
class Weights:
    cfg: ModelConfig
    token_embd: Mat                             # (V, E): one row per token
    output: Mat                                 # (V, E): token_embd when the file has no output
    output_hc_norm: np.ndarray                  # (hc, E)
    output_hc_down: Mat
    output_hc_up: Mat
    layers: list[LayerWeights]
    per_layer_token_embd: Mat | None = None     # (n_rows, ple_row): the PLE table, read by rows only
    notes: list[str] = field(default_factory=list)


def _attr(name: str) -> str:
    """GGUF tensor name -> attribute: 'blk.3.indexer.q_proj.weight' -> 'indexer_q_proj'."""
    base = name.split(".", 2)[2] if name.startswith("blk.") else name
    return base.removesuffix(".weight").removesuffix(".bias").replace(".", "_")


def check_tensor(gf: GGUFFile, spec: Spec, lm_head: bool = False) -> TensorInfo:
    """The tensor of `spec`, its shape and its type checked; `lm_head`: token_embd is also the LM head (tied)."""
    t = gf.tensor(spec.name)
    if spec.name == "per_layer_token_embd.weight":
        # the converter pads the table to a multiple of 128 rows; the hash ranges set the minimum
        want_row, want_rows = spec.shapes[0]
        if len(t.shape) != 2 or t.shape[0] != want_row or t.shape[1] < want_rows:
            raise GGUFError(f"{gf.path}: tensor '{spec.name}' has ggml shape {list(t.shape)}, expected "
                            f"[{want_row}, >= {want_rows}] (embedding_length_per_layer_input and the PLE head ranges)")
    elif t.shape not in spec.shapes:
        raise GGUFError(f"{gf.path}: tensor '{spec.name}' has ggml shape {list(t.shape)}, the metadata implies "
                        f"{' or '.join(str(list(s)) for s in spec.shapes)}")
    if spec.vector and t.qtype.name not in FLOAT_TYPES:
        raise GGUFError(f"{gf.path}: tensor '{spec.name}' is {t.qtype.name}; strata expects "
                        f"{'/'.join(FLOAT_TYPES)} for norms and per-head vectors")
    # the PLE table and an untied embedding are read by rows (dequantize takes every type); the rest are matmuls
    by_rows = spec.name == "per_layer_token_embd.weight" or spec.name == "token_embd.weight" and not lm_head
    if not spec.vector and not by_rows and t.qtype.name not in MATRIX_TYPES:
        role = "the LM head (there is no output.weight)" if lm_head else "a matrix"
        raise GGUFError(f"{gf.path}: tensor '{spec.name}' is {t.qtype.name}, which strata's CPU kernels do not run "
                        f"as {role}; the matrix types are {', '.join(MATRIX_TYPES)}")
    return t


def load_weights(gf: GGUFFile, cfg: ModelConfig, exact: bool = False) -> Weights:
    """Check every tensor against `cfg` and wrap it. `exact` selects f32 activations in quantized matvecs."""
    found: dict[str, TensorInfo] = {}
    tied = "output.weight" not in gf
    for spec in all_specs(cfg):
        if spec.name in gf:
            found[spec.name] = check_tensor(gf, spec, lm_head=tied and spec.name == "token_embd.weight")
        elif spec.required:
            fused = spec.name.replace("ffn_gate_exps", "ffn_gate_up_exps").replace("ffn_up_exps", "ffn_gate_up_exps")
            if fused == spec.name or fused not in gf:
                raise GGUFError(f"{gf.path}: missing tensor '{spec.name}'")
    unused = [n for n in gf.tensors if n not in found]
    if unused:
        # llama.cpp refuses these too ("wrong number of tensors"): a tensor nobody reads is a file misdescribed
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise GGUFError(f"{gf.path}: tensor {unused[0]!r}{more} is not part of the model the metadata describes: "
                        f"a key such as block_count or ple.layers does not match the tensors")

    def wrap(t: TensorInfo, spec_vector: bool):
        if spec_vector:
            v = _vector(t)
            # grouped-norm gammas come as [hc*E] or [E, hc]; both are hc rows of E
            grouped = "hc_" in t.name or "ple_norm" in t.name
            return v.reshape(cfg.hc, cfg.n_embd) if grouped else v
        return Mat.from_tensor(t, exact)

    vector_names = {s.name for s in all_specs(cfg) if s.vector}
    g = {n: wrap(t, n in vector_names) for n, t in found.items() if not n.startswith("blk.")}
    layers = []
    for il in range(cfg.n_layer):
        lw = LayerWeights(il, "gdn" if cfg.recurrent[il] else "qsa")
        prefix = f"blk.{il}."
        for n, t in found.items():
            if n.startswith(prefix):
                setattr(lw, _attr(n), wrap(t, n in vector_names))
        if lw.ffn_gate_inp_shexp is not None:
            lw.ffn_gate_inp_shexp = lw.ffn_gate_inp_shexp.reshape(-1)
        layers.append(lw)
    notes = list(cfg.notes)
    output = g.get("output.weight")
    if output is None:
        output = g["token_embd.weight"]
        notes.append("no output.weight: the LM head reads token_embd (tied embeddings)")
    return Weights(cfg, g["token_embd.weight"], output, g["output_hc_norm.weight"], g["output_hc_down.weight"],
                   g["output_hc_up.weight"], layers, g.get("per_layer_token_embd.weight"), notes)
