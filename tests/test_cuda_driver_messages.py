"""The driver wrappers' error messages are formatted only when a call fails (the hot paths, the doorbell poll and
the expert copies, pass their numbers, not a built string), and name the call and its subject when one does.
Runs everywhere: the CUDA bindings are replaced by a fake whose calls succeed or fail on demand."""

from __future__ import annotations

from enum import Enum
from types import SimpleNamespace

import pytest

from strata.cuda import driver as drv
from strata.cuda import graphs


class R(Enum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_ILLEGAL_ADDRESS = 700


class Unformattable(str):
    """A message that fails if it is ever %-formatted: the success paths must never touch it."""

    def __mod__(self, args):
        raise AssertionError(f"formatted on a success path: {str(self)!r} % {args!r}")


@pytest.fixture
def fake_cu(monkeypatch):
    state = {"res": R.CUDA_SUCCESS}
    cu = SimpleNamespace(
        CUresult=R,
        cuGetErrorName=lambda res: (R.CUDA_SUCCESS, res.name.encode()),
        cuMemcpyHtoDAsync=lambda *a: (state["res"],),
        cuMemcpyDtoHAsync=lambda *a: (state["res"],),
        cuMemsetD8Async=lambda *a: (state["res"],),
        cuEventQuery=lambda h: (state["res"],),
        cuEventSynchronize=lambda h: (state["res"],),
        cuStreamSynchronize=lambda h: (state["res"],),
        cuGraphLaunch=lambda *a: (state["res"],))
    monkeypatch.setattr(drv, "cu", cu)
    monkeypatch.setattr(graphs, "cu", cu)
    return state


def test_messages_are_built_only_on_failure(fake_cu):
    stream = SimpleNamespace(handle=1, prev_kernel=True)
    ev = object.__new__(drv.Event)
    ev.handle = 2
    g = object.__new__(graphs.Graph)
    g.exec, g.name = 3, Unformattable("b512.post[%d]")
    bad = Unformattable("expert %d.%d -> slot %d")
    drv.memcpy_htod_async(0, 0, 16, stream, bad, 1, 2, 3)
    drv.memcpy_dtoh_async(0, 0, 16, stream, bad, 1, 2, 3)
    drv.memset_async(0, 16, stream, bad)
    assert ev.query(bad, 4) is True
    ev.synchronize(bad, 4)
    drv.Stream.synchronize(stream, bad, 4)
    g.launch(stream)
    assert drv.check((R.CUDA_SUCCESS, 7), bad, 1) == 7
    fake_cu["res"] = R.CUDA_ERROR_NOT_READY
    assert ev.query(bad, 4) is False                             # not ready is an answer, not an error

    fake_cu["res"] = R.CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(drv.CudaError, match=r"cuMemcpyHtoDAsync \(expert 1\.2 -> slot 3, 16 B\): "
                                            r"CUDA_ERROR_ILLEGAL_ADDRESS"):
        drv.memcpy_htod_async(0, 0, 16, stream, "expert %d.%d -> slot %d", 1, 2, 3)
    with pytest.raises(drv.CudaError, match=r"cuEventQuery \(pre\[5\]\)"):
        ev.query("pre[%d]", 5)
    with pytest.raises(drv.CudaError, match=r"cuStreamSynchronize \(close\)"):
        drv.Stream.synchronize(stream, "close")
    with pytest.raises(drv.CudaError, match=r"cuGraphLaunch\(b16\.pre\[0\]\)"):
        g.name = "b16.pre[0]"
        g.launch(stream)
    with pytest.raises(drv.CudaError, match=r"cuMemsetD8Async \(arena 100%, 16 B\)"):
        drv.memset_async(0, 16, stream, "arena 100%")           # no arguments: the text as it is
