"""A model file replaced between ModelDir.open's checks and the first read of its bytes: a FIFO renamed over
dense.bin blocked the mapping in open() for ever, and a shorter file was mapped as it was (a tensor cut short, a
reshape traceback). Both are now one-line ModelFormatErrors naming the file. Links still read as their target."""

from __future__ import annotations

import os
import secrets
import shutil

import numpy as np
import pytest

from common.errors import ModelFormatError
from common.model_format import ModelDir
from tests.helpers import outcome_unblocked

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def model(tiny_model, tmp_path):
    copy = tmp_path / f"model-{secrets.token_hex(3)}"
    shutil.copytree(tiny_model, copy)
    return copy


def _dense_tensor(model: ModelDir) -> str:
    return next(name for name, e in model.entries.items() if e.file == "dense.bin")


def test_a_fifo_renamed_over_a_checked_file_is_refused_not_waited_on(model):
    opened = ModelDir.open(model, verify=False)
    fifo = model / f".swap-{secrets.token_hex(3)}"
    os.mkfifo(fifo)
    os.replace(fifo, model / "dense.bin")
    result = outcome_unblocked(lambda: opened.raw_bytes(_dense_tensor(opened)))
    assert isinstance(result, ModelFormatError) and "dense.bin" in str(result) and "a FIFO" in str(result), result


def test_a_file_cut_short_after_the_checks_is_refused(model):
    opened = ModelDir.open(model, verify=False)
    path = model / "dense.bin"
    cut = int(np.random.default_rng().integers(0, path.stat().st_size))
    os.truncate(path, cut)
    result = outcome_unblocked(lambda: opened.raw_bytes(_dense_tensor(opened)))
    assert isinstance(result, ModelFormatError) and str(path) in str(result), result


def test_files_reached_through_links_inside_the_directory_still_read(model):
    (model / "weights").mkdir()
    os.replace(model / "dense.bin", model / "weights" / "dense.bin")
    (model / "dense.bin").symlink_to("weights/dense.bin")
    os.link(model / "weights" / "dense.bin", model / "weights" / "hard.bin")
    opened = ModelDir.open(model, verify=True)
    name = _dense_tensor(opened)
    assert len(opened.raw_bytes(name)) == opened.entries[name].nbytes
