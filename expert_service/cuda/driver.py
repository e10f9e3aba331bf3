"""Thin helpers over the CUDA driver API (cuda.bindings) for what Numba does not expose: page-locking
read-only mmaps, stream capture into graphs, and graph replay."""

from __future__ import annotations

import logging

import numpy as np
from cuda.bindings import driver as drv

from expert_service.kernels import programmatic

log = logging.getLogger("colibri.worker.cuda")


class CudaDriverError(RuntimeError):
    def __init__(self, message: str, code: drv.CUresult | None = None):
        super().__init__(message)
        self.code = code  # the driver's CUresult (device_memory tells an out-of-memory error by it)


def check(result):
    """cuda.bindings calls return (CUresult, *values): raise on an error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise CudaDriverError(f"CUDA driver error {name.decode() if isinstance(name, bytes) else name}", err)
    return values[0] if len(values) == 1 else values


def device_address(array) -> int:
    """The device address of a Numba device array (or view) as an int, for driver and cuBLAS calls (under the
    simulator, whose arrays are numpy's, their host address: offsets between views still hold)."""
    interface = getattr(array, "__cuda_array_interface__", None) or array.__array_interface__
    return int(interface["data"][0])


def stream_handle(stream) -> drv.CUstream:
    """The driver handle of a Numba stream (handle is a CUstream or a ctypes pointer by binding)."""
    handle = stream.handle
    value = getattr(handle, "value", None)
    return drv.CUstream(int(value if value is not None else int(handle)))


def non_blocking_stream():
    """(driver handle, Numba external stream) of a new stream that does not synchronise with stream 0."""
    from numba import cuda

    cuda.current_context()  # the driver call needs Numba's (primary) context to be current
    handle = check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING))
    return handle, cuda.external_stream(int(handle))


class Event:
    """A CUDA event (no timing): recorded after a step's work on its stream, then polled (`ready`) or waited
    for (`wait`: the calling thread spins in the driver, which releases the GIL)."""

    def __init__(self):
        self.handle = check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING))

    def record(self, stream_handle) -> None:
        check(drv.cuEventRecord(self.handle, stream_handle))

    def ready(self) -> bool:
        err = drv.cuEventQuery(self.handle)
        err = err[0] if isinstance(err, tuple) else err
        if err == drv.CUresult.CUDA_ERROR_NOT_READY:
            return False
        check(err)
        return True

    def wait(self) -> None:
        check(drv.cuEventSynchronize(self.handle))

    def close(self) -> None:
        if self.handle is not None:
            check(drv.cuEventDestroy(self.handle))
            self.handle = None


def pin_readonly(array: np.ndarray, mapped: bool = False) -> bool:
    """Page-locks the host range of a read-only array (an mmap) so copies from it run at PCIe speed; `mapped`:
    also maps it into the device's address space (kernels read it: mapped_address). Returns False when the
    driver refuses (limits, unsupported), so the caller can fall back."""
    if array.nbytes == 0:
        return True
    flags = drv.CU_MEMHOSTREGISTER_READ_ONLY | (drv.CU_MEMHOSTREGISTER_DEVICEMAP if mapped else 0)
    try:
        check(drv.cuMemHostRegister(array.ctypes.data, array.nbytes, flags))
        return True
    except CudaDriverError as e:
        log.warning("could not page-lock %d bytes of model weights (%s)", array.nbytes, e)
        return False


def mapped_address(array: np.ndarray) -> int:
    """The device address of a host array registered with `pin_readonly(mapped=True)` (on the H200 the host
    address itself; the driver says)."""
    return int(check(drv.cuMemHostGetDevicePointer(array.ctypes.data, 0)))


def unpin(array: np.ndarray) -> None:
    try:
        check(drv.cuMemHostUnregister(array.ctypes.data))
    except CudaDriverError:
        pass


def function_handles(handles: set[int]) -> set[int]:
    """The handles a kernel node may record for these kernel handles: each itself, and where it is a
    context-independent CUkernel (numba-cuda loads modules as libraries through cuda.core) the CUfunction it
    resolves to in the current context."""
    found = set(handles)
    for handle in handles:
        try:
            found.add(int(check(drv.cuKernelGetFunction(drv.CUkernel(handle)))))
        except CudaDriverError:
            pass  # a CUfunction already
    return found


def programmatic_edges(graph, waiting: set[int]) -> int:
    """Turns every kernel -> kernel edge of a captured graph whose target runs one of the `waiting` kernels
    (handles of kernels that wait for their predecessor first: kernels/programmatic.py) into a programmatic
    edge, so the target's blocks may start while its predecessor drains; returns how many. cuda.bindings 12
    names the edge-data calls *_v2, 13 drops the suffix."""
    if not waiting:
        return 0
    waiting = function_handles(waiting)
    get = getattr(drv, "cuGraphGetEdges_v2", None) or drv.cuGraphGetEdges
    add = getattr(drv, "cuGraphAddDependencies_v2", None) or drv.cuGraphAddDependencies
    remove = getattr(drv, "cuGraphRemoveDependencies_v2", None) or drv.cuGraphRemoveDependencies
    count = check(get(graph, 0))[-1]
    if not count:
        return 0
    sources, targets = check(get(graph, count))[:2]
    kernel = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
    recorded: dict[int, set[int] | None] = {}  # a node on several edges is read once

    def runs(node) -> set[int] | None:
        """The handles a kernel node records (its function, its library kernel), None for other nodes."""
        key = int(node)
        if key not in recorded:
            if check(drv.cuGraphNodeGetType(node)) != kernel:
                recorded[key] = None
            else:
                params = check(drv.cuGraphKernelNodeGetParams(node))
                recorded[key] = {int(params.func), int(getattr(params, "kern", 0))} - {0}
        return recorded[key]

    changed = 0
    for a, b in zip(sources, targets):
        target = runs(b)
        if not target or not target & waiting or runs(a) is None:
            continue
        data = drv.CUgraphEdgeData()
        data.type = drv.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
        data.from_port = drv.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
        check(remove(graph, [a], [b], None, 1))
        check(add(graph, [a], [b], [data], 1))
        changed += 1
    return changed


class Graph:
    """A captured sequence of launches on one stream, replayed with one call. Edges into kernels that wait for
    their predecessor (kernels/programmatic.py) become programmatic when the capture ends."""

    def __init__(self, stream):
        self.stream = stream
        self._handle = stream_handle(stream)
        self.exec = None
        self.programmatic_edges = 0  # how many, once captured

    def __enter__(self) -> Graph:
        check(drv.cuStreamBeginCapture(self._handle, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        return self

    def __exit__(self, exc_type, exc, tb):
        graph = check(drv.cuStreamEndCapture(self._handle))
        try:
            if exc_type is None:
                self.programmatic_edges = programmatic_edges(graph, programmatic.handles())
                self.exec = check(drv.cuGraphInstantiate(graph, 0))
        finally:
            check(drv.cuGraphDestroy(graph))
        return False

    def replay(self) -> None:
        check(drv.cuGraphLaunch(self.exec, self._handle))

    def close(self) -> None:
        if self.exec is not None:
            check(drv.cuGraphExecDestroy(self.exec))
            self.exec = None


class Pieces:
    """A pass captured as graphs between host breaks (HostBreaks), replayed in order: after every graph but the
    last, that break's host work (`resume`) runs eagerly. A pass without breaks is one graph."""

    def __init__(self):
        self.graphs: list = []
        self.resumes: list = []

    def replay(self) -> None:
        for graph, resume in zip(self.graphs, self.resumes + [None]):
            graph.replay()
            if resume is not None:
                resume()

    def close(self) -> None:
        for graph in self.graphs:
            graph.close()


class HostBreaks:
    """Where an issued pass needs the host between two launches (a readback the later launches' sizes depend
    on): the issuing code calls `breaks(resume)` with that host work, which synchronises itself. Eagerly this
    is resume(). While a GraphCache captures, the piece captured so far ends and runs, resume() runs eagerly and
    a new piece begins: the pass becomes graphs around host steps, and replays the same way (Pieces)."""

    def __init__(self, stream):
        self.stream = stream
        self._pieces: Pieces | None = None
        self._graph = None  # the piece being captured

    def __call__(self, resume) -> None:
        if self._pieces is None:
            resume()
            return
        graph, self._graph = self._graph, None
        graph.__exit__(None, None, None)
        self._pieces.graphs.append(graph)
        self._pieces.resumes.append(resume)
        graph.replay()
        resume()
        following = Graph(self.stream)
        following.__enter__()  # only a capture that began is ended on failure
        self._graph = following

    def capture(self, issue) -> Pieces:
        """issue() captured in pieces; every piece but the last has already run (the caller replays the last)."""
        if self._pieces is not None:
            raise RuntimeError("a capture is already in progress on this stream")
        pieces = self._pieces = Pieces()
        try:
            self._graph = Graph(self.stream)
            self._graph.__enter__()
            try:
                issue()
            except BaseException as exc:
                if self._graph is not None:  # None: a break failed between two pieces
                    self._graph.__exit__(type(exc), exc, exc.__traceback__)
                raise
            self._graph.__exit__(None, None, None)
            pieces.graphs.append(self._graph)
        except BaseException:
            pieces.close()
            raise
        finally:
            self._pieces = self._graph = None
        return pieces


class GraphCache:
    """Passes captured per key (a step's padded shape): the first pass of a key runs eagerly, which loads every
    kernel it launches (capture cannot load modules), the second is captured and replayed, later ones replay.
    A pass with host breaks is captured in pieces around them (`breaks`, shared by the caches of one stream). A
    key whose capture fails runs eagerly from then on (one warning), rather than failing every later step."""

    def __init__(self, stream, breaks: HostBreaks | None = None):
        self.stream = stream
        self.breaks = breaks if breaks is not None else HostBreaks(stream)
        self._graphs: dict[object, Pieces] = {}
        self._seen: set[object] = set()
        self._eager: set[object] = set()

    def run(self, key, issue) -> None:
        """issue(): launches the pass on self.stream (the same launches for the same key, every time)."""
        pieces = self._graphs.get(key)
        if pieces is not None:
            pieces.replay()
            return
        if key in self._seen and key not in self._eager:
            try:
                pieces = self.breaks.capture(issue)
            except Exception as exc:
                # nothing ran, or (failing after a host break) its first pieces did: the eager pass below redoes
                # the whole pass, which writes the same values to the same buffers and KV slots
                log.warning("CUDA graph capture of step shape %s failed (%s); that shape runs eagerly", key, exc)
                self._eager.add(key)
            else:
                self._graphs[key] = pieces
                pieces.graphs[-1].replay()
                return
        self._seen.add(key)
        issue()

    def __contains__(self, key) -> bool:
        return key in self._graphs

    def __iter__(self):
        return iter(self._graphs)

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Forgets every graph (the caller synchronises first): each key runs eagerly once more, then is captured."""
        for graph in self._graphs.values():
            graph.close()
        self._graphs.clear()
        self._seen.clear()
        self._eager.clear()
