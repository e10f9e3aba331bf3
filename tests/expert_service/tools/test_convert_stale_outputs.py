"""`colibri convert` into a directory that held another model: what the model directory's readers take by name and
the conversion does not rewrite (the routing table and its report, leftovers of a killed write, expert files of
layers the new model lacks) is removed, files of other names are left alone, and a keep_hot table the conversion
reads from there is refused rather than deleted."""

from __future__ import annotations

import json
import logging
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from colibri.cli import main
from common.model_format import ModelDir
from common.routing_table import COUNTS_SUFFIX, NO_EXPERT, TABLE_FILE, RoutingTable, model_digest, write_routing_table
from expert_service.engine.config import EngineConfig
from expert_service.experts.routing_plan import worker_plan_table
from expert_service.tools.convert import convert
from expert_service.tools.tiny_model import tiny_hf_config, tiny_weights, write_tiny_checkpoint


def checkpoint(root: Path, seed: int, **overrides) -> Path:
    """The tiny mixtral checkpoint with HF config overrides (e.g. more layers)."""
    hf_dir = write_tiny_checkpoint(root, "mixtral", seed)
    hf = {**tiny_hf_config("mixtral"), **overrides}
    (hf_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    save_file(tiny_weights(hf, seed), str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return hf_dir


def random_table(model: ModelDir, seed: int) -> np.ndarray:
    cfg = model.config
    scores = np.random.default_rng(seed).random((len(cfg.moe_layers), cfg.vocab_size, cfg.num_experts))
    return np.argsort(scores, axis=2)[:, :, : cfg.num_experts_per_tok].astype(np.uint16)


def write_version_1(path: Path, table: np.ndarray, num_experts: int) -> None:
    """A table as written before the header recorded the model: only its shape can tell it is another's."""
    body = table.astype("<u2").tobytes()
    path.write_bytes(struct.pack("<4s6I", b"CLRT", 1, *table.shape, num_experts, zlib.crc32(body)) + body)


@pytest.mark.parametrize("version", [1, 2])
def test_reconverting_leaves_no_routing_table_or_expert_file_of_the_earlier_model(tmp_path, caplog, version):
    """A routing_table.bin built for the earlier model stayed, and the worker's plan prefetch (or a router given
    it) used a table of another model; a version-1 table has the same shape, so nothing at load could tell."""
    seed = int(np.random.default_rng().integers(0, 1000))
    out = tmp_path / "m"
    earlier = ModelDir.open(convert(checkpoint(tmp_path / "a", seed, num_hidden_layers=4), out, progress=False))
    table = random_table(earlier, seed)
    if version == 1:
        write_version_1(out / TABLE_FILE, table[:2], earlier.config.num_experts)  # the later model's shape
    else:
        write_routing_table(out / TABLE_FILE, table, earlier.config.num_experts, model_digest(out))
    (out / f"{TABLE_FILE}.report.json").write_text('{"model": "the earlier one"}')
    for leftover in (f"{TABLE_FILE}.tmp", "colibri.json.tmp"):
        (out / leftover).write_bytes(b"a killed write's")
    others = {"notes.txt": b"the operator's", "lut.bin": b"a table named elsewhere", "experts-old.bin": b"not ours"}
    for name, data in others.items():
        (out / name).write_bytes(data)
    outside = tmp_path / "kept-table.bin"
    outside.write_bytes(b"a table outside the directory")
    with caplog.at_level(logging.WARNING, logger="colibri.convert"):
        later = ModelDir.open(convert(checkpoint(tmp_path / "b", seed + 1), out, progress=False))
    names = sorted(p.name for p in out.iterdir())
    model_files = [
        "colibri.json",
        "dense.bin",
        "experts-L000.bin",
        "experts-L001.bin",
        *later.manifest["tokenizer_files"],
    ]
    assert names == sorted([*model_files, *others]), names
    assert all((out / name).read_bytes() == data for name, data in others.items())
    removed = [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]
    # a version-2 table is settled once the new model is written (kept only if built for it): a second line
    assert len(removed) == version and not any("\n" in line for line in removed), removed
    for name in (TABLE_FILE, f"{TABLE_FILE}.report.json", "experts-L002.bin", "experts-L003.bin"):
        assert name in " ".join(removed)
    assert worker_plan_table(later, EngineConfig(prefetch="plan")) is None  # the router's plans, not a stale table
    # a link at the table's name is removed, the file it pointed at is not
    (out / TABLE_FILE).symlink_to(outside)
    convert(checkpoint(tmp_path / "c", seed + 2), out, progress=False)
    assert not (out / TABLE_FILE).is_symlink() and not (out / TABLE_FILE).exists()
    assert outside.read_bytes() == b"a table outside the directory"


def test_a_keep_hot_table_in_the_output_directory_is_refused_before_anything_changes(tmp_path, capsys):
    """The quantization flow (convert in bf16, router-gen, convert again with keep_hot) pointed at OUT_DIR's own
    table would have the conversion delete the table it reads: refused in one line, the directory left as it was."""
    seed = int(np.random.default_rng().integers(0, 1000))
    hf_dir = checkpoint(tmp_path / "hf", seed)
    out = tmp_path / "m"
    model = ModelDir.open(convert(hf_dir, out, dtype="bfloat16", progress=False))
    write_routing_table(out / TABLE_FILE, random_table(model, seed), model.config.num_experts, model_digest(out))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    plan = tmp_path / "plan.yaml"
    plan.write_text(f"keep_hot: {{routing_table: {out / TABLE_FILE}, per_layer: 1}}\n")
    capsys.readouterr()
    argv = ["convert", str(hf_dir), str(out), "--expert-dtype", "int8", "--expert-dtype-file", str(plan)]
    rc = main([*argv, "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"keep_hot.routing_table {out / TABLE_FILE} is {out / TABLE_FILE}, which converting into" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    RoutingTable.load(out / TABLE_FILE, model.config, model_digest(out))  # still the bf16 model's, intact
    # moved out of the directory, the same table feeds the conversion, and the directory's stale one is gone
    moved = (out / TABLE_FILE).rename(tmp_path / "bf16-table.bin")
    plan.write_text(f"keep_hot: {{routing_table: {moved}, per_layer: 1}}\n")
    assert main(argv) == 0
    assert not (out / TABLE_FILE).exists() and ModelDir.open(out).expert_formats


def test_names_a_model_directory_never_uses_as_files_are_left_alone(tmp_path, caplog):
    """A directory at routing_table.bin (or at an expert file's name) stopped the conversion with an
    IsADirectoryError traceback, after other files were already removed; a file named like an expert file in a
    form no layer is written under (experts-L0007.bin) was removed as a stale expert file."""
    seed = int(np.random.default_rng().integers(0, 1000))
    out = tmp_path / "m"
    ModelDir.open(convert(checkpoint(tmp_path / "a", seed, num_hidden_layers=4), out, progress=False))
    layer = int(np.random.default_rng().integers(5, 99))
    dirs = [TABLE_FILE, f"{TABLE_FILE}.report.json", f"experts-L{layer:03d}.bin"]
    for name in dirs:
        (out / name).mkdir()
        (out / name / "mine.txt").write_text("the operator's")
    user_file = out / f"experts-L{layer:04d}.bin"
    user_file.write_bytes(b"the operator's")
    with caplog.at_level(logging.WARNING, logger="colibri.convert"):
        later = ModelDir.open(convert(checkpoint(tmp_path / "b", seed + 1), out, progress=False))
    assert all((out / name / "mine.txt").read_text() == "the operator's" for name in dirs)
    assert user_file.read_bytes() == b"the operator's"
    removed = [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]
    assert len(removed) == 1 and "experts-L002.bin, experts-L003.bin" in removed[0], removed
    assert user_file.name not in removed[0] and TABLE_FILE + "," not in removed[0]
    assert later.config.moe_layers


@pytest.mark.parametrize("gated", [False, True])
def test_converting_the_same_checkpoint_again_keeps_the_table_built_for_it(tmp_path, caplog, gated):
    """A convert run twice over the same checkpoint with the same settings (a Job restarted) writes the same model,
    whose routing table stays valid: it was deleted, and plan prefetch lost it until `colibri router-gen` ran again.
    A conversion with other settings is another model: its table still goes. A gated table (version 3, router-gen
    --min-share) is kept or removed the same way, its counts file (--save-counts) with it."""
    seed = int(np.random.default_rng().integers(0, 1000))
    hf_dir, out = checkpoint(tmp_path / "hf", seed), tmp_path / "m"
    model = ModelDir.open(convert(hf_dir, out, dtype="bfloat16", progress=False))
    table = random_table(model, seed)
    if gated:
        table[:, ::3, 1:] = NO_EXPERT
    write_routing_table(out / TABLE_FILE, table, model.config.num_experts, model_digest(out))
    assert struct.unpack_from("<I", (out / TABLE_FILE).read_bytes(), 4) == (3 if gated else 2,)
    report, counts = out / f"{TABLE_FILE}.report.json", out / f"{TABLE_FILE}{COUNTS_SUFFIX}"
    report.write_text('{"recall": 0.5}')
    counts.write_bytes(b"router-gen's counts")
    with caplog.at_level(logging.INFO, logger="colibri.convert"):
        again = ModelDir.open(convert(hf_dir, out, dtype="bfloat16", progress=False))
    assert np.array_equal(RoutingTable.load(out / TABLE_FILE, again.config, model_digest(out)).table, table)
    assert report.read_text() == '{"recall": 0.5}' and counts.read_bytes() == b"router-gen's counts"
    assert not [r for r in caplog.records if "removed" in r.getMessage()]
    convert(hf_dir, out, dtype="bfloat16", expert_dtype="int8", progress=False)
    assert not (out / TABLE_FILE).exists() and not report.exists() and not counts.exists()
