"""Reading the checkpoint's shards: a shard name that holds no regular file is refused in one line naming what is
there, never waited on, even when it is swapped in after the shard was opened."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors import safe_open

from common.errors import ModelFormatError
from common.model_format import ModelDir
from expert_service.tools.tiny_model import write_tiny_checkpoint
from tests.expert_service.tools.test_convert_hf_files import place, run_cli
from tests.helpers import serve_env

SHARD = "model.safetensors"
WHY = "every *.safetensors here is read as a shard"


@pytest.mark.timeout(120)  # opening the FIFO would wait for a writer for ever
@pytest.mark.parametrize("kind", ["a FIFO", "a directory", "a character device"])
def test_a_shard_the_index_lists_that_is_no_regular_file_is_named_as_such(tmp_path, capsys, kind):
    hf = write_tiny_checkpoint(tmp_path / "hf", "qwen2_moe", seed=3)
    with safe_open(hf / SHARD, framework="numpy") as f:
        weight_map = {name: SHARD for name in f.keys()}
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    place(hf / SHARD, kind)
    rc, out, err = run_cli(capsys, "convert", str(hf), str(tmp_path / "m"), "--no-progress")
    assert (rc, out) == (ModelFormatError.exit_code, ""), err
    assert err == f"colibri convert: error: {hf / SHARD}: not a regular file ({kind}); {WHY}\n"
    assert not (tmp_path / "m").exists()


# safe_open, handed whatever name the shard is opened by, finds a FIFO there: it was swapped in after the shard was
# opened and checked. A subprocess, so a conversion that waits on it (holding the GIL) can be ended.
SWAPPED_AFTER_OPEN = """
import os, sys
from pathlib import Path
from expert_service.tools import safetensors_checkpoint
from expert_service.tools.convert import convert

shard, real_safe_open = Path(sys.argv[1]), safetensors_checkpoint.safe_open

def swapping_safe_open(name, *args, **kwargs):
    if not (shard.parent / "moved").exists():
        shard.rename(shard.parent / "moved")
        os.mkfifo(shard)
    return real_safe_open(name, *args, **kwargs)

safetensors_checkpoint.safe_open = swapping_safe_open
convert(shard.parent, sys.argv[2], progress=False)
"""


def test_a_shard_swapped_for_a_fifo_after_it_was_opened_is_never_waited_on(tmp_path):
    """The shard was checked by its name, then opened by name twice more (safe_open, then the mmap): a FIFO put
    there in between blocked the conversion for ever. The file opened and checked is the one read."""
    hf = write_tiny_checkpoint(tmp_path / "hf", "mixtral", seed=2)
    out = tmp_path / "m"
    command = [sys.executable, "-c", SWAPPED_AFTER_OPEN, str(hf / SHARD), str(out)]
    try:
        done = subprocess.run(command, capture_output=True, timeout=60, env=serve_env())
    except subprocess.TimeoutExpired:
        pytest.fail("a FIFO swapped in at the shard's name blocked the conversion")
    assert done.returncode == 0, done.stderr.decode()
    assert os.path.exists(hf / "moved") and ModelDir.open(out, verify=True).config.family == "mixtral"
