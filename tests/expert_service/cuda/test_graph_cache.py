"""cuda/driver.py's GraphCache with a recording stand-in for the driver's Graph (no GPU): the first pass of a key
runs eagerly, the second is captured and replayed, later ones only replay; keys are independent; clear() closes
every graph and starts each key over; a pass with host breaks is captured and replayed in pieces around them."""

from __future__ import annotations

import expert_service.cuda.driver as driver
from expert_service.cuda.driver import GraphCache, HostBreaks


class RecordingGraph:
    log: list = []

    def __init__(self, stream):
        self.stream, self.closed = stream, False

    def __enter__(self):
        self.log.append("begin capture")
        return self

    def __exit__(self, *exc):
        self.log.append("end capture")
        return False

    def replay(self):
        self.log.append("replay")

    def close(self):
        self.closed = True
        self.log.append("close")


def recording_cache(monkeypatch, graph=RecordingGraph):
    """(log, breaks, cache): a GraphCache and its HostBreaks capturing into `graph` stand-ins that write to log."""
    monkeypatch.setattr(driver, "Graph", graph)
    RecordingGraph.log = log = []
    breaks = HostBreaks(stream="s")
    return log, breaks, GraphCache(stream="s", breaks=breaks)


def test_eager_then_captured_then_replayed_per_key(monkeypatch):
    monkeypatch.setattr(driver, "Graph", RecordingGraph)
    RecordingGraph.log = log = []
    cache = GraphCache(stream="s")
    launch = {key: (lambda key=key: log.append(f"launch {key}")) for key in (48, 64)}
    cache.run(48, launch[48])
    assert log == ["launch 48"] and 48 not in cache and not cache
    cache.run(48, launch[48])
    assert log[1:] == ["begin capture", "launch 48", "end capture", "replay"] and 48 in cache
    cache.run(64, launch[64])  # another key starts eagerly
    cache.run(48, launch[48])
    assert log[5:] == ["launch 64", "replay"] and list(cache) == [48] and len(cache) == 1
    graph = cache._graphs[48].graphs[0]
    cache.clear()
    assert graph.closed and not cache
    del log[:]
    cache.run(48, launch[48])  # after clear(): eager again, then captured
    assert log == ["launch 48"]


def test_a_failed_capture_runs_that_shape_eagerly_from_then_on(monkeypatch, caplog):
    """A capture that fails (instantiation out of memory, a launch the capture refuses) leaves no graph: that pass
    runs eagerly at once, and so does every later pass of that key, with one warning; other keys still capture."""
    monkeypatch.setattr(driver, "Graph", RecordingGraph)
    RecordingGraph.log = log = []
    cache = GraphCache(stream="s")
    calls = {"n": 0}

    def launch():
        calls["n"] += 1
        log.append("launch")
        if calls["n"] == 2:  # the capture pass
            raise RuntimeError("CUDA driver error CUDA_ERROR_OUT_OF_MEMORY")

    cache.run(8, launch)
    with caplog.at_level("WARNING", logger="colibri.worker.cuda"):
        cache.run(8, launch)  # capture fails, then the same pass eagerly
    assert 8 not in cache and log == ["launch", "begin capture", "launch", "end capture", "launch"]
    assert "capture of step shape 8 failed" in caplog.text
    del log[:]
    cache.run(8, launch)
    assert log == ["launch"] and 8 not in cache  # eager, no second attempt
    cache.run(16, lambda: None)
    cache.run(16, lambda: None)
    assert 16 in cache
    cache.clear()  # a fresh start may capture again
    cache.run(8, lambda: None)
    cache.run(8, lambda: None)
    assert 8 in cache


def test_a_pass_with_host_breaks_is_captured_and_replayed_in_pieces(monkeypatch):
    """Each break ends the piece captured so far, runs it, then its host work eagerly; capture goes on in a new
    piece. Replays run the pieces in order with the host work between them; eagerly the host work runs inline."""
    log, breaks, cache = recording_cache(monkeypatch)

    def issue():
        log.append("launch a")
        breaks(lambda: log.append("host 1"))
        log.append("launch b")
        breaks(lambda: log.append("host 2"))
        log.append("launch c")

    cache.run(512, issue)
    assert log == ["launch a", "host 1", "launch b", "host 2", "launch c"]
    del log[:]
    cache.run(512, issue)
    assert log == [
        "begin capture",
        "launch a",
        "end capture",
        "replay",
        "host 1",
        "begin capture",
        "launch b",
        "end capture",
        "replay",
        "host 2",
        "begin capture",
        "launch c",
        "end capture",
        "replay",
    ]
    assert len(cache._graphs[512].graphs) == 3
    del log[:]
    cache.run(512, issue)
    assert log == ["replay", "host 1", "replay", "host 2", "replay"]
    pieces = cache._graphs[512].graphs
    cache.clear()
    assert all(g.closed for g in pieces)


def test_a_capture_failing_after_a_break_closes_its_pieces_and_runs_eagerly(monkeypatch, caplog):
    """A launch refused in a later piece: the pieces already captured are closed (nothing kept), the whole pass
    runs eagerly (it writes the same values again), and the key stays eager."""
    log, breaks, cache = recording_cache(monkeypatch)
    calls = {"n": 0}

    def issue():
        calls["n"] += 1
        log.append("launch a")
        breaks(lambda: log.append("host"))
        if calls["n"] == 2:
            raise RuntimeError("CUDA driver error CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED")
        log.append("launch b")

    cache.run(8, issue)
    del log[:]
    with caplog.at_level("WARNING", logger="colibri.worker.cuda"):
        cache.run(8, issue)
    assert log == [
        "begin capture",
        "launch a",
        "end capture",
        "replay",
        "host",
        "begin capture",
        "end capture",
        "close",
        "launch a",
        "host",
        "launch b",
    ]
    assert 8 not in cache and "capture of step shape 8 failed" in caplog.text
    assert breaks._pieces is None  # a later capture may start
    cache.run(16, issue)
    cache.run(16, issue)
    assert 16 in cache


def test_host_work_failing_during_capture_leaves_nothing_captured(monkeypatch, caplog):
    """resume() raising while a pass is captured (a cuBLAS error, say): the piece that ran is closed, no capture
    is left open, the pass then runs eagerly (and fails or not on its own), and a later capture may start."""
    log, breaks, cache = recording_cache(monkeypatch)
    failing = {"on": False}

    def resume():
        log.append("host")
        if failing["on"]:
            failing["on"] = False
            raise RuntimeError("cublasGemmEx failed with cuBLAS status 13")

    def issue():
        log.append("launch a")
        breaks(resume)
        log.append("launch b")

    cache.run(4, issue)
    failing["on"] = True
    del log[:]
    with caplog.at_level("WARNING", logger="colibri.worker.cuda"):
        cache.run(4, issue)
    assert log == [
        "begin capture",
        "launch a",
        "end capture",
        "replay",
        "host",
        "close",
        "launch a",
        "host",
        "launch b",
    ]
    assert "cuBLAS status 13" in caplog.text and 4 not in cache
    assert breaks._pieces is None and breaks._graph is None


def test_a_piece_that_cannot_begin_capture_reports_its_own_error(monkeypatch, caplog):
    """The next piece's BeginCapture failing: that graph never began, so it is not ended (which would raise a
    second, misleading error); the warning names the first one and the pieces already captured are closed."""

    class RefusingGraph(RecordingGraph):
        made = 0

        def __enter__(self):
            RefusingGraph.made += 1
            if RefusingGraph.made == 2:
                raise RuntimeError("CUDA driver error CUDA_ERROR_ILLEGAL_STATE")
            return super().__enter__()

    log, breaks, cache = recording_cache(monkeypatch, RefusingGraph)

    def issue():
        log.append("launch a")
        breaks(lambda: log.append("host"))
        log.append("launch b")

    cache.run(2, issue)
    del log[:]
    with caplog.at_level("WARNING", logger="colibri.worker.cuda"):
        cache.run(2, issue)
    assert log == [
        "begin capture",
        "launch a",
        "end capture",
        "replay",
        "host",
        "close",
        "launch a",
        "host",
        "launch b",
    ]
    assert "CUDA_ERROR_ILLEGAL_STATE" in caplog.text and 2 not in cache and breaks._pieces is None
