"""HostUploader's page-locking lifetime (CPU: the driver calls are replaced by recorders)."""
import gc

import numpy as np

import expert_service.cuda.weights as weights


def recorders(monkeypatch):
    pinned, unpinned = [], []
    monkeypatch.setattr(weights, "pin_readonly", lambda host: pinned.append(host.ctypes.data) or True)
    monkeypatch.setattr(weights, "unpin", lambda host: unpinned.append(host.ctypes.data))
    return pinned, unpinned


def test_release_unpins_every_pinned_range_once(monkeypatch):
    pinned, unpinned = recorders(monkeypatch)
    uploader = weights.HostUploader(stream=None)
    hosts = [np.random.default_rng(i).integers(0, 255, 64, dtype=np.uint8) for i in range(3)]
    assert all(uploader.pin(h) for h in hosts)
    uploader.release()
    uploader.release()
    assert sorted(unpinned) == sorted(pinned) and len(unpinned) == 3


def test_an_uploader_dropped_without_release_still_unpins(monkeypatch):
    """A registration that outlives its mmap makes the driver refuse later allocations at those addresses."""
    pinned, unpinned = recorders(monkeypatch)
    uploader = weights.HostUploader(stream=None)
    uploader.pin(np.arange(32, dtype=np.uint8))
    del uploader
    gc.collect()
    assert unpinned == pinned and len(pinned) == 1


def test_refused_ranges_are_not_unpinned(monkeypatch):
    pinned, unpinned = recorders(monkeypatch)
    monkeypatch.setattr(weights, "pin_readonly", lambda host: False)
    uploader = weights.HostUploader(stream=None)
    assert not uploader.pin(np.arange(32, dtype=np.uint8))
    uploader.release()
    assert unpinned == []
