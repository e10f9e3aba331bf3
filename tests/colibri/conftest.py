"""Every test here runs with a temporary directory of its own (TMPDIR for the processes it starts, tempfile's for
this one), and fails if a `colibri serve` it ran left its private directory (colibri-serve-*) behind."""

from __future__ import annotations

import tempfile

import pytest


@pytest.fixture(autouse=True)
def serve_private_dirs_removed(tmp_path_factory, monkeypatch):
    tmp = tmp_path_factory.mktemp("tmpdir")
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    yield
    left = sorted(p.name for p in tmp.glob("colibri-serve-*"))
    assert not left, f"colibri serve's private directories left behind: {left}"
