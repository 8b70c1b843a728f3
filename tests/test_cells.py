"""strata.host.cells: a cell is reused only once the array given out and every view of it are gone."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from strata.host.cells import Cells, numpy_chunks


def test_cells_reuse_only_after_every_view_is_gone():
    c = Cells(5000, numpy_chunks, chunk_bytes=3 * 8192, align=4096)
    assert (c.cell_bytes, c.per_chunk) == (8192, 3)
    a = c.take(5000)
    a[:] = 7
    view = a[100:200].reshape(10, 10)
    addr = view.__array_interface__["data"][0] - 100
    del a
    gc.collect()
    assert c.live == 1                                    # the view still holds the cell
    others = [c.take(10) for _ in range(2)]               # the rest of the chunk: not the held cell
    assert all(o.__array_interface__["data"][0] != addr for o in others) and len(c._chunks) == 1
    assert (view == 7).all()
    del view
    gc.collect()
    assert c.live == 2
    again = c.take(8192)                                  # the freed cell comes back before a new chunk
    assert again.__array_interface__["data"][0] == addr and len(c._chunks) == 1
    assert c.owns(again) and c.owns(others[0][2:5]) and not c.owns(np.zeros(4, np.uint8))
    with pytest.raises(ValueError, match="do not fit"):
        c.take(8193)
    c.close()
    assert c.nbytes == 0
