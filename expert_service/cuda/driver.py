"""Thin helpers over the CUDA driver API (cuda.bindings) for what Numba does not expose: page-locking
read-only mmaps, stream capture into graphs, and graph replay."""
from __future__ import annotations

import logging

import numpy as np
from cuda.bindings import driver as drv

log = logging.getLogger("colibri.worker.cuda")


class CudaDriverError(RuntimeError):
    pass


def check(result):
    """cuda.bindings calls return (CUresult, *values): raise on an error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise CudaDriverError(f"CUDA driver error {name.decode() if isinstance(name, bytes) else name}")
    return values[0] if len(values) == 1 else values


def device_address(array) -> int:
    """The device address of a Numba device array (or view) as an int, for driver and cuBLAS calls."""
    return array.__cuda_array_interface__["data"][0]


def stream_handle(stream) -> drv.CUstream:
    """The driver handle of a Numba stream (handle is a CUstream or a ctypes pointer by binding)."""
    handle = stream.handle
    value = getattr(handle, "value", None)
    return drv.CUstream(int(value if value is not None else int(handle)))


def non_blocking_stream():
    """(driver handle, Numba external stream) of a new stream that does not synchronise with stream 0."""
    from numba import cuda
    cuda.current_context()       # the driver call needs Numba's (primary) context to be current
    handle = check(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING))
    return handle, cuda.external_stream(int(handle))


def pin_readonly(array: np.ndarray) -> bool:
    """Page-locks the host range of a read-only array (an mmap) so copies from it run at PCIe speed.
    Returns False when the driver refuses (limits, unsupported), so the caller can fall back."""
    if array.nbytes == 0:
        return True
    try:
        check(drv.cuMemHostRegister(array.ctypes.data, array.nbytes, drv.CU_MEMHOSTREGISTER_READ_ONLY))
        return True
    except CudaDriverError as e:
        log.warning("could not page-lock %d bytes of model weights (%s)", array.nbytes, e)
        return False


def unpin(array: np.ndarray) -> None:
    try:
        check(drv.cuMemHostUnregister(array.ctypes.data))
    except CudaDriverError:
        pass


class Graph:
    """A captured sequence of launches on one stream, replayed with one call."""

    def __init__(self, stream):
        self.stream = stream
        self._handle = stream_handle(stream)
        self.exec = None

    def __enter__(self) -> "Graph":
        check(drv.cuStreamBeginCapture(self._handle,
                                       drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        return self

    def __exit__(self, exc_type, exc, tb):
        graph = check(drv.cuStreamEndCapture(self._handle))
        if exc_type is None:
            self.exec = check(drv.cuGraphInstantiate(graph, 0))
        check(drv.cuGraphDestroy(graph))
        return False

    def replay(self) -> None:
        check(drv.cuGraphLaunch(self.exec, self._handle))

    def close(self) -> None:
        if self.exec is not None:
            check(drv.cuGraphExecDestroy(self.exec))
            self.exec = None


class GraphCache:
    """Passes captured per key (a step's padded shape): the first pass of a key runs eagerly, which loads every
    kernel it launches (capture cannot load modules), the second is captured and replayed, later ones replay. A
    key whose capture fails runs eagerly from then on (one warning), rather than failing every later step."""

    def __init__(self, stream):
        self.stream = stream
        self._graphs: dict[object, Graph] = {}
        self._seen: set[object] = set()
        self._eager: set[object] = set()

    def run(self, key, issue) -> None:
        """issue(): launches the pass on self.stream (the same launches for the same key, every time)."""
        graph = self._graphs.get(key)
        if graph is None and key in self._seen and key not in self._eager:
            graph = Graph(self.stream)
            try:
                with graph:
                    issue()
            except Exception as exc:       # nothing ran: the capture only recorded the launches
                log.warning("CUDA graph capture of step shape %s failed (%s); that shape runs eagerly", key, exc)
                self._eager.add(key)
                graph = None
            else:
                self._graphs[key] = graph
        if graph is None:
            self._seen.add(key)
            issue()
        else:
            graph.replay()

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
