"""A checkpoint `colibri convert` refuses leaves the model OUT_DIR already holds loadable: every check that needs
no pass over the weights (fp8 block scales' values included) runs before the old manifest is removed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from colibri.cli import main
from common.errors import ModelFormatError
from common.model_format import ModelDir
from common.model_manifest import MANIFEST
from common.routing_table import TABLE_FILE
from expert_service.tools.tiny_model import tiny_hf_config, write_tiny_checkpoint
from tests.expert_service.tools.fp8_checkpoint import write_fp8_checkpoint


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def good_model(tmp_path: Path, capsys) -> tuple[Path, dict[str, bytes]]:
    """OUT_DIR holding a converted model and a file of a name convert would remove; returns it and its files' bytes."""
    write_tiny_checkpoint(tmp_path / "good", "qwen3_moe", seed=1)
    out = tmp_path / "m"
    rc, _, err = run_cli(capsys, "convert", str(tmp_path / "good"), str(out), "--no-progress")
    assert rc == 0, err
    (out / TABLE_FILE).write_bytes(b"an earlier model's routing table")
    return out, {p.name: p.read_bytes() for p in out.iterdir()}


def assert_still_loads(out: Path, before: dict[str, bytes], capsys) -> None:
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # not a byte changed, nothing removed
    ModelDir.open(out, verify=True)
    rc, stdout, err = run_cli(capsys, "verify", str(out), "--no-progress")
    assert rc == 0 and stdout.startswith("ok: "), err


def bad_scale_checkpoint(hf: Path, rng: np.random.Generator, value: float) -> str:
    """An fp8 checkpoint with `value` at a random block of a random weight's scale; returns that scale's name."""
    from safetensors.torch import load_file, save_file

    write_fp8_checkpoint(hf, tiny_hf_config("qwen3_moe"), seed=int(rng.integers(1 << 16)))
    tensors = load_file(str(hf / "model.safetensors"))
    scales = sorted(name for name in tensors if name.endswith("_scale_inv"))
    name = scales[int(rng.integers(len(scales)))]
    index = tuple(int(rng.integers(n)) for n in tensors[name].shape)
    tensors[name][index] = value
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -2.0, 2.0**120])
def test_a_bad_fp8_scale_leaves_the_model_there_loadable(tmp_path, capsys, seed, value):
    """The scales were checked only as each was written, after colibri.json and the routing table were gone."""
    out, before = good_model(tmp_path, capsys)
    rng = np.random.default_rng([seed, int(np.float32(value).view(np.uint32))])
    name = bad_scale_checkpoint(tmp_path / "bad", rng, value)
    rc, _, err = run_cli(capsys, "convert", str(tmp_path / "bad"), str(out), "--no-progress")
    assert rc == ModelFormatError.exit_code and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"tensor {name}" in err and ("non-finite block scales" in err or "invalid scale" in err), err
    assert_still_loads(out, before, capsys)


def test_a_refused_config_leaves_the_model_there_loadable(tmp_path, capsys):
    """A config.json refusal (here a count of 0) is decided before anything in OUT_DIR changes."""
    out, before = good_model(tmp_path, capsys)
    write_tiny_checkpoint(tmp_path / "bad", "qwen3_moe", seed=2)
    config = json.loads((tmp_path / "bad" / "config.json").read_text())
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**config, "num_experts": 0}))
    rc, _, err = run_cli(capsys, "convert", str(tmp_path / "bad"), str(out), "--no-progress")
    assert rc != 0 and err.count("\n") == 1 and "num_experts" in err, err
    assert (out / MANIFEST).is_file()
    assert_still_loads(out, before, capsys)
