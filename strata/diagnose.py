"""Where a forward first went non-finite: the reference re-run over the tokens a sequence was fed, every stage of
every layer at every position watched for NaN or inf (the C1 dump's seams, none of its memory).

    where = first_nonfinite(model, tokens)     # NonFinite(pos, layer, stage) or None
    raise FloatingPointError(f"non-finite logits: the first non-finite value is at {where}")

Forward order is strata.reference.model.stage_order's: position first (a later position depends on every earlier
one), then layer, then stage, so the answer is where the NaN or inf was made, not where it spread to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from strata.model.loader import Model
from strata.reference.model import RefModel, StageDump, stage_order

CHUNK = 256           # tokens per reference step, as Engine.logits runs them


@dataclass(frozen=True)
class NonFinite:
    """The first (position, layer, stage) whose value holds NaN or inf; layer -1: the embedding or the LM head."""
    pos: int
    layer: int
    stage: str

    def __str__(self) -> str:
        if self.stage == "embed":
            return f"the embedding (token_embd.weight) at position {self.pos}"
        if self.stage == "logits":
            return f"the LM head (output_hc_*, output.weight) at position {self.pos}"
        return f"layer {self.layer} (blk.{self.layer}.*), stage '{self.stage}', at position {self.pos}"


@dataclass
class _Watch(StageDump):
    """A StageDump that keeps no values, only the keys whose value is not all finite."""
    bad: list = field(default_factory=list)

    def put(self, pos: int, layer: int, stage: str, value: np.ndarray) -> None:
        if not np.isfinite(value).all():
            self.bad.append((pos, layer, stage))


def first_nonfinite(model: Model, tokens: Sequence[int], *, ref: RefModel | None = None,
                    chunk: int = CHUNK) -> NonFinite | None:
    """The first stage holding a non-finite value when the reference is fed `tokens` (ids the model accepts) from
    position 0, or None when every value is finite. `ref`: a RefModel over model.weights to reuse. Stops at the
    first chunk that held one; costs one reference forward over those tokens (memory: one step's values)."""
    ref = ref if ref is not None else RefModel(model.weights)
    watch = _Watch()
    st = ref.new_state(watch)
    with np.errstate(all="ignore"):          # the NaN is the finding here, not a warning
        for a in range(0, len(tokens), chunk):
            ref.chunk(st, list(tokens[a:a + chunk]))
            if watch.bad:
                return NonFinite(*min(watch.bad, key=stage_order))
    return None
