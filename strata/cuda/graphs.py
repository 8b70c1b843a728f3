"""Stream capture into CUDA graphs: a captured sequence of launches and copies, replayed with one cuGraphLaunch.

A graph copies kernel arguments and copy addresses at capture and never re-reads them (the seed's rule two):
what changes per step must be data in device buffers, which a replay does re-read.
"""

from __future__ import annotations

from collections.abc import Callable

from strata.cuda.driver import CudaError, Stream, check, cu


class Graph:
    def __init__(self, name: str, stream: Stream, body: Callable[[], None], fallback: bool = True):
        """Capture body()'s enqueues on `stream` (thread-local mode: other threads' calls are not captured).
        If capturing or instantiating fails while programmatic launches are on (strata.cuda.launch), they are
        turned off for the process and the body is captured again (fallback=False: the error is raised)."""
        from strata.cuda import launch
        self.name = name
        try:
            self._capture(stream, body)
        except CudaError as e:
            if not (fallback and launch.pdl_on()):
                raise
            launch.set_pdl(False, f"off: capturing graph {name} failed with it ({e})")
            self._capture(stream, body)

    def _capture(self, stream: Stream, body: Callable[[], None]) -> None:
        name = self.name
        stream.prev_kernel = False          # a graph's first kernel has no kernel before it
        check(cu.cuStreamBeginCapture(stream.handle, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
              f"cuStreamBeginCapture({name})")
        try:
            body()
        except BaseException:
            cu.cuStreamEndCapture(stream.handle)       # leave the stream usable; the body's error is the news
            stream.prev_kernel = False
            raise
        stream.prev_kernel = False
        self.graph = check(cu.cuStreamEndCapture(stream.handle), f"cuStreamEndCapture({name})")
        got = check(cu.cuGraphGetNodes(self.graph, 0), f"cuGraphGetNodes({name})")
        self.n_nodes = int(got[-1]) if isinstance(got, tuple) else len(got)
        if self.n_nodes == 0:
            raise CudaError(f"graph {name}: nothing was captured")
        try:
            self.exec = check(cu.cuGraphInstantiate(self.graph, 0), f"cuGraphInstantiate({name})")
        except CudaError:
            cu.cuGraphDestroy(self.graph)
            raise

    def launch(self, stream: Stream) -> None:
        check(cu.cuGraphLaunch(self.exec, stream.handle), "cuGraphLaunch(%s)", self.name)
        stream.prev_kernel = False

    def destroy(self) -> None:
        check(cu.cuGraphExecDestroy(self.exec), f"cuGraphExecDestroy({self.name})")
        check(cu.cuGraphDestroy(self.graph), f"cuGraphDestroy({self.name})")
