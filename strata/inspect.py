"""`cli.py inspect MODEL`: metadata, tensor types and bytes, and the bytes one decoded token reads."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from gguf import GGUFValueType

from strata.model.loader import Model


def per_token_bytes(m: Model) -> dict[str, int]:
    """Bytes read to decode one token, by part: dense matrices whole, one embedding row, the routed share of
    each expert tensor (k of n experts), and one row per PLE head."""
    cfg = m.cfg
    parts: dict[str, int] = defaultdict(int)
    for name, t in m.file.tensors.items():
        if name == "token_embd.weight":
            parts["embedding row"] += t.row_bytes
            if "output.weight" not in m.file:
                parts["dense (LM head)"] += t.nbytes
        elif name == "per_layer_token_embd.weight":
            parts["PLE rows"] += t.row_bytes * cfg.ple_heads
        elif "_exps" in name:
            parts["routed experts"] += t.nbytes * cfg.n_expert_used // cfg.n_expert
        elif name == "output.weight":
            parts["dense (LM head)"] += t.nbytes
        else:
            parts["dense (layers)"] += t.nbytes
    parts["total"] = sum(parts.values())
    return dict(parts)


def routing_summary(meta: dict) -> str | None:
    """make-model's strata.routing.* keys in words; None for a file without them (not made by make-model)."""
    routing = meta.get("strata.routing")
    if routing is None:
        return None
    if routing == "uniform":
        return "uniform (random routers: tokens spread almost evenly over the experts, a cache's worst case)"
    text = f"{routing}"
    if "strata.routing.skew" in meta:
        text += f": skew {meta['strata.routing.skew']:.3g} (log-std of the experts' router-logit scales)"
    if "strata.routing.lru_hit_rate" in meta and "strata.routing.lru_capacity" in meta:
        text += (f"; calibrated LRU hit rate {meta['strata.routing.lru_hit_rate']:.1%} with "
                 f"{meta['strata.routing.lru_capacity']:.0%} of each layer's experts cached")
    return text


def report(m: Model) -> str:
    cfg, gf = m.cfg, m.file
    lines = [f"file      {gf.path}", f"size      {gf.size / 2**30:.3f} GiB  (GGUF v{gf.version}, {len(gf.tensors)} tensors)"]
    lines.append("metadata")
    for k, v in gf.metadata.items():
        if isinstance(v, list) and len(v) > 16:
            v = f"[{len(v)} items: {', '.join(map(repr, v[:4]))}, ...]"
        elif gf.value_types[k][0] == GGUFValueType.FLOAT32:
            v = str(np.float32(v))          # the stored value's shortest form: 0.45, not 0.44999998807907104
        lines.append(f"  {k:52s} {v}")
    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for t in gf.tensors.values():
        e = by_type[t.qtype.name]
        e[0] += 1
        e[1] += t.nbytes
        e[2] += t.n_elements
    lines.append("tensor types")
    lines.append(f"  {'type':8s} {'tensors':>8s} {'GiB':>10s} {'params':>14s} {'bits/param':>10s}")
    for name, (n, b, el) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  {name:8s} {n:8d} {b / 2**30:10.3f} {el:14,d} {8 * b / max(el, 1):10.2f}")
    lines.append("geometry")
    lines.append(f"  layers {cfg.n_layer} ({sum(cfg.recurrent)} GDN + {cfg.n_layer - sum(cfg.recurrent)} QSA), "
                 f"hidden {cfg.n_embd}, vocab {cfg.n_vocab}, experts {cfg.n_expert} top-{cfg.n_expert_used} x "
                 f"{cfg.n_ff_exp}, hc {cfg.hc}, PLE layer {list(cfg.ple_layers)} ({cfg.ple_table_rows:,} rows)")
    routing = routing_summary(gf.metadata)
    if routing:
        lines.append(f"routing   {routing}")
    lines.append("bytes read per decoded token")
    for k, v in per_token_bytes(m).items():
        lines.append(f"  {k:20s} {v / 2**20:12.2f} MiB")
    for n in m.weights.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)
