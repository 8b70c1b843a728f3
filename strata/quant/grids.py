"""Lookup tables of the IQ formats: codebook grids and the even-parity sign table.

The grids are the ones of ggml-common.h (iq2xxs_grid ...), taken from the gguf package, which ships them
packed as 2- or 3-bit indices into a few byte levels; each row is one codebook entry of 8 (IQ2) or 4 (IQ3)
unsigned magnitudes.
"""

from __future__ import annotations

import numpy as np
from gguf import quants as _gq


def _grid(cls) -> np.ndarray:
    cls.init_grid()
    return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape).astype(np.uint8))


IQ2XXS_GRID = _grid(_gq.IQ2_XXS)   # uint8 (256, 8)
IQ2XS_GRID = _grid(_gq.IQ2_XS)     # uint8 (512, 8)
IQ2S_GRID = _grid(_gq.IQ2_S)       # uint8 (1024, 8)
IQ3XXS_GRID = _grid(_gq.IQ3_XXS)   # uint8 (256, 4)
IQ3S_GRID = _grid(_gq.IQ3_S)       # uint8 (512, 4)

# ksigns_iq2xs: 7 stored sign bits -> 8 sign bits, the 8th making the count of negatives even
_i = np.arange(128, dtype=np.uint8)
KSIGNS = (_i | ((np.unpackbits(_i[:, None], axis=1).sum(1) & 1).astype(np.uint8) << 7)).astype(np.uint8)  # (128,)
del _i
