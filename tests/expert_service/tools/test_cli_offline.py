"""`colibri make-tiny` and `colibri verify` through the real CLI: determinism, the tokenizer, and every way a
model directory can be broken, each a one-line error naming the file or tensor with a non-zero exit."""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from colibri.cli import main
from common.errors import ChecksumError, ModelFormatError
from common.model_format import ModelDir
from common.model_manifest import MANIFEST
from common.models import FAMILIES
from expert_service.tools.tiny_model import BOS_ID, EOS_ID, VOCAB_SIZE, make_tiny

TEXTS = [
    "Hello, world!",
    "héllo wörld ß ø",
    "日本語のテキスト",
    "emoji 🦜🔥👩‍👩‍👧 and\ttabs\n\nnewlines  ",
    "<s> looks special but is text",
    "\x00\x7f control \u200b zero-width",
    "",
]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def broken(tiny, tmp_path) -> Path:
    """A private copy of the tiny model for a test to damage."""
    return Path(shutil.copytree(tiny, tmp_path / "model", ignore=shutil.ignore_patterns("hf")))


def edit_manifest(model_dir: Path, edit) -> None:
    manifest = json.loads((model_dir / MANIFEST).read_text())
    edit(manifest)
    (model_dir / MANIFEST).write_text(json.dumps(manifest))


def assert_one_line_error(capsys, model_dir: Path, exit_code: int, *names: str) -> str:
    rc, out, err = run_cli(capsys, "verify", str(model_dir), "--no-progress")
    assert rc == exit_code, err
    assert err.startswith("colibri verify: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and out == ""
    for name in names:
        assert name in err, (name, err)
    return err


# --- make-tiny ---------------------------------------------------------------------------------------------


def test_make_tiny_cli_then_verify(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "make-tiny", str(tmp_path / "m"), "--no-progress")
    assert rc == 0 and "mixtral" in out and f"vocab {VOCAB_SIZE}" in out
    rc, out, err = run_cli(capsys, "verify", str(tmp_path / "m"), "--no-progress")
    model = ModelDir.open(tmp_path / "m", verify=False)
    assert rc == 0 and out == f"ok: {len(model.entries)} tensors, {model.total_bytes:,} bytes verified\n"


HF_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def plant_links(directory: Path, names, link: str, outside: Path) -> dict[Path, bytes]:
    """A symlink or a hard link at each name in `directory`, to a file of its own under `outside`; returns what
    those files hold, which the tool must leave as it is."""
    outside.mkdir(exist_ok=True)
    directory.mkdir(parents=True, exist_ok=True)
    kept = {}
    for name in names:
        target = outside / name.replace("/", "_")
        target.write_bytes(b"not the tool's " + name.encode())
        kept[target] = target.read_bytes()
        if link == "symlink":
            (directory / name).symlink_to(target)
        else:
            (directory / name).hardlink_to(target)
    return kept


@pytest.mark.parametrize("link", ["symlink", "hard link"])
def test_make_tiny_replaces_a_link_in_its_checkpoint_directory_instead_of_writing_through_it(tmp_path, capsys, link):
    """The HF checkpoint's files went through write_text, safetensors' save_file and Tokenizer.save, which follow a
    symlink (and write into a hard link's shared file): OUT_DIR/hf/config.json -> /etc/something was overwritten."""
    out = tmp_path / "m"
    kept = plant_links(out / "hf", HF_FILES, link, tmp_path / "elsewhere")
    rc, _, err = run_cli(capsys, "make-tiny", str(out), "--no-progress")
    assert rc == 0, err
    assert {target: target.read_bytes() for target in kept} == kept
    assert not any((out / "hf" / name).is_symlink() for name in HF_FILES)
    fresh = make_tiny(tmp_path / "fresh")
    for name in HF_FILES:
        assert (out / "hf" / name).read_bytes() == (fresh / "hf" / name).read_bytes(), name
    ModelDir.open(out)  # checksums included


def test_make_tiny_replaces_a_symlink_at_its_checkpoint_directory(tmp_path, capsys):
    """OUT_DIR/hf -> another directory: the checkpoint was written into that directory, replacing its files."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("not the tool's")
    out = tmp_path / "m"
    out.mkdir()
    (out / "hf").symlink_to(elsewhere, target_is_directory=True)
    rc, _, err = run_cli(capsys, "make-tiny", str(out), "--no-progress")
    assert rc == 0, err
    assert [p.name for p in elsewhere.iterdir()] == ["config.json"]
    assert (elsewhere / "config.json").read_text() == "not the tool's"
    assert (out / "hf").is_dir() and not (out / "hf").is_symlink() and (out / "hf" / "config.json").is_file()


def test_make_tiny_default_model_shape(tiny):
    model = ModelDir.open(tiny)
    c = model.config
    assert (c.family, c.vocab_size, c.hidden_size, c.num_hidden_layers) == ("mixtral", VOCAB_SIZE, 64, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.num_experts, c.num_experts_per_tok) == (4, 2, 4, 2)
    assert (c.moe_intermediate_size, c.max_position_embeddings) == (96, 2048)
    assert c.bos_token_id == BOS_ID and c.eos_token_ids == (EOS_ID,)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_make_tiny_is_deterministic(tmp_path, family):
    a = make_tiny(tmp_path / "a", family, seed=5)
    b = make_tiny(tmp_path / "b", family, seed=5)
    c = make_tiny(tmp_path / "c", family, seed=6)
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for file in files:
        assert (a / file).read_bytes() == (b / file).read_bytes(), file
    crcs = {n: t["crc32"] for n, t in json.loads((a / MANIFEST).read_text())["tensors"].items()}
    other = {n: t["crc32"] for n, t in json.loads((c / MANIFEST).read_text())["tensors"].items()}
    assert crcs.keys() == other.keys() and all(crcs[n] != other[n] for n in crcs)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_any_text(tiny, text):
    tokenizer = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    ids = tokenizer.encode(text).ids
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    if text.isascii() and "<s>" not in text:
        assert ids == [3 + b for b in text.encode()]  # one token per byte


def test_tokenizer_specials(tiny):
    tokenizer = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    assert tokenizer.token_to_id("<s>") == BOS_ID and tokenizer.token_to_id("</s>") == EOS_ID
    assert tokenizer.decode([BOS_ID, 3 + ord("a"), EOS_ID]) == "a"


# --- verify: every broken directory is a one-line error --------------------------------------------------------


def test_flipped_byte_names_file_and_tensor(broken, capsys):
    entry = json.loads((broken / MANIFEST).read_text())["tensors"]["layers.1.experts.2.up_proj"]
    with open(broken / entry["file"], "r+b") as f:
        f.seek(entry["offset"] + 17)
        byte = f.read(1)
        f.seek(entry["offset"] + 17)
        f.write(bytes([byte[0] ^ 0x10]))
    err = assert_one_line_error(
        capsys, broken, ChecksumError.exit_code, "experts-L001.bin", "layers.1.experts.2.up_proj", "checksum mismatch"
    )
    assert "crc32" in err
    # Loading verifies too, unless told to skip.
    with pytest.raises(ChecksumError):
        ModelDir.open(broken)
    ModelDir.open(broken, verify=False)


def test_truncated_file(broken, capsys):
    size = (broken / "dense.bin").stat().st_size
    os.truncate(broken / "dense.bin", size - 100)
    assert_one_line_error(capsys, broken, ModelFormatError.exit_code, "dense.bin", "truncated")


def test_offset_past_end_of_file(broken, capsys):
    def edit(m):
        m["tensors"]["layers.0.q_proj"]["offset"] = 10**9

    edit_manifest(broken, edit)
    assert_one_line_error(
        capsys, broken, ModelFormatError.exit_code, "layers.0.q_proj", "dense.bin", "offset past the end"
    )


def test_nbytes_not_matching_dtype_and_shape(broken, capsys):
    def edit(m):  # fp32 data declared bf16: the byte count is twice what bf16 x shape needs
        m["tensors"]["embed_tokens"]["dtype"] = "bfloat16"

    edit_manifest(broken, edit)
    assert_one_line_error(capsys, broken, ModelFormatError.exit_code, "embed_tokens", "bfloat16", "do not fit")


@pytest.mark.parametrize("path", ["/etc/passwd", "../model/dense.bin", "sub/../../dense.bin", "dense.bin\0"])
def test_path_escaping_the_directory(broken, capsys, path):
    def edit(m):
        m["tensors"]["final_norm"]["file"] = path

    edit_manifest(broken, edit)
    assert_one_line_error(capsys, broken, ModelFormatError.exit_code, "final_norm", repr(path), "must be relative")


def test_symlink_leaving_the_directory(broken, tmp_path, capsys):
    outside = tmp_path / "outside.bin"
    shutil.copyfile(broken / "dense.bin", outside)
    (broken / "link.bin").symlink_to(outside)

    def edit(m):
        m["tensors"]["final_norm"]["file"] = "link.bin"

    edit_manifest(broken, edit)
    assert_one_line_error(
        capsys, broken, ModelFormatError.exit_code, "final_norm", "link.bin", "outside the model directory"
    )


def test_missing_tensor(broken, capsys):
    edit_manifest(broken, lambda m: m["tensors"].pop("layers.1.experts.3.down_proj"))
    assert_one_line_error(capsys, broken, ModelFormatError.exit_code, "layers.1.experts.3.down_proj", "missing")


def test_missing_data_file(broken, capsys):
    (broken / "experts-L000.bin").unlink()
    assert_one_line_error(capsys, broken, ModelFormatError.exit_code, "experts-L000.bin", "not found")


def test_unknown_model_type_lists_supported(broken, capsys):
    def edit(m):
        m["config"]["model_type"] = "llama"

    edit_manifest(broken, edit)
    assert_one_line_error(
        capsys, broken, ModelFormatError.exit_code, "'llama'", "supported: mixtral, olmoe, qwen2_moe, qwen3_moe"
    )


@pytest.mark.parametrize("text", ['{"format": "colibri", ', "[1, 2, 3]", '"just a string"', "\xff\xfe"])
def test_malformed_manifest(broken, capsys, text):
    (broken / MANIFEST).write_text(text, encoding="latin-1")
    assert_one_line_error(capsys, broken, ModelFormatError.exit_code, MANIFEST)


@pytest.mark.parametrize(
    "key, value",
    [
        ("tensors", []),
        ("tensors", {"embed_tokens": 5}),
        ("config", []),
        ("format_version", 3),
        ("format_version", True),
        ("expert_strides", None),
        ("expert_strides", {"0": "x"}),
        ("expert_strides", {}),
        ("dtype", "int4"),
        ("dtype", "int8"),
        ("dtype", []),
        ("expert_stride", "x"),
    ],
)
def test_malformed_manifest_fields(broken, capsys, key, value):
    def edit(m):
        m[key] = value

    edit_manifest(broken, edit)
    assert_one_line_error(capsys, broken, ModelFormatError.exit_code)


@pytest.mark.parametrize("workers", ["0", "-3"])
def test_verify_refuses_fewer_than_one_worker(tiny, capsys, workers):
    rc, out, err = run_cli(capsys, "verify", str(tiny), "--workers", workers, "--no-progress")
    assert (rc, out, err) == (2, "", f"colibri verify: error: --workers: must be >= 1, got {workers}\n")


def test_not_a_model_directory(tmp_path, capsys):
    assert_one_line_error(capsys, tmp_path, ModelFormatError.exit_code, MANIFEST, "colibri convert")


def test_os_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    rc, out, err = run_cli(capsys, "make-tiny", str(tmp_path / "a_file" / "model"), "--no-progress")
    assert rc == 1 and err.count("\n") == 1 and "a_file" in err and "Traceback" not in err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_logits_write_failure_is_an_error_naming_the_file(tiny_model, capsys):
    assert main(["logits", "--model", str(tiny_model), "--tokens", "1,2,3", "--out", "/dev/full"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "colibri logits: error: /dev/full: No space left on device", err
    assert not os.path.exists("/dev/full.npy")


def test_logits_writes_exactly_the_named_file(tiny_model, tmp_path):
    out = tmp_path / "logits.bin"
    assert main(["logits", "--model", str(tiny_model), "--tokens", "1,2,3", "--out", str(out)]) == 0
    assert out.is_file() and not (tmp_path / "logits.bin.npy").exists()


@pytest.fixture(scope="module")
def tiny_int8(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny_int8") / "model", expert_dtype="int8")


@pytest.mark.parametrize("value", [float("nan"), 0.0])
def test_a_bad_scale_with_a_matching_checksum_is_one_line(tiny_int8, tmp_path, capsys, value):
    broken = Path(shutil.copytree(tiny_int8, tmp_path / "model", ignore=shutil.ignore_patterns("hf")))
    name = "layers.1.experts.2.up_proj_scale"
    entry = json.loads((broken / MANIFEST).read_text())["tensors"][name]
    data = bytearray((broken / entry["file"]).read_bytes())
    data[entry["offset"] : entry["offset"] + 4] = np.float32(value).astype("<f4").tobytes()
    (broken / entry["file"]).write_bytes(bytes(data))
    crc = zlib.crc32(data[entry["offset"] : entry["offset"] + entry["nbytes"]])
    edit_manifest(broken, lambda m: m["tensors"][name].update(crc32=crc))
    err = assert_one_line_error(capsys, broken, ModelFormatError.exit_code, entry["file"], name, "invalid scale")
    assert f"{value} at [0]" in err
    rc, out, err = run_cli(capsys, "logits", "--model", str(broken), "--tokens", "1,2,3", "--out", str(tmp_path / "l"))
    assert rc == ModelFormatError.exit_code and err.startswith("colibri logits: error: ") and err.count("\n") == 1
    assert name in err and "Traceback" not in err


# --- logits / complete: the prompt --------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["logits", "complete"])
@pytest.mark.parametrize("tokens", ["1 2 3", "1,2 3", "4, 5 6,7"])
def test_token_ids_separated_by_spaces_are_refused_not_joined(tiny_model, tmp_path, capsys, command, tokens):
    rest = ["--out", str(tmp_path / "l.npy")] if command == "logits" else ["--max-new-tokens", "1"]
    rc, out, err = run_cli(capsys, command, "--model", str(tiny_model), "--tokens", tokens, *rest)
    assert rc == 2 and out == "" and err.count("\n") == 1, (rc, out, err)
    assert err.startswith(f"colibri {command}: error: --tokens: expected comma-separated integers"), err
    assert not (tmp_path / "l.npy").exists()


def test_token_ids_may_have_spaces_around_the_commas(tiny_model, capsys):
    rc, out, _ = run_cli(
        capsys, "complete", "--model", str(tiny_model), "--tokens", " 1 , 2,3 ", "--max-new-tokens", "1"
    )
    assert rc == 0 and json.loads(out)["prompt_tokens"] == 3


@pytest.mark.parametrize("command", ["logits", "complete"])
def test_a_prompt_longer_than_the_context_names_the_flag(tiny_model, tmp_path, capsys, command):
    limit = ModelDir.open(tiny_model, verify=False).config.max_position_embeddings
    rest = ["--out", str(tmp_path / "l.npy")] if command == "logits" else []
    tokens = ",".join(["5"] * (limit + 1))
    rc, out, err = run_cli(capsys, command, "--model", str(tiny_model), "--tokens", tokens, *rest)
    assert rc == 2 and out == "" and err.count("\n") == 1, (rc, err)
    assert err == f"colibri {command}: error: --tokens: {limit + 1} tokens exceed max_position_embeddings {limit}\n"


@pytest.mark.parametrize("value", ["0", "-5"])
def test_complete_refuses_fewer_than_one_new_token(tiny_model, capsys, value):
    rc, out, err = run_cli(capsys, "complete", "--model", str(tiny_model), "--tokens", "1,2", "--max-new-tokens", value)
    assert (rc, out) == (2, ""), (rc, out)
    assert err == f"colibri complete: error: --max-new-tokens: must be >= 1, got {value}\n"


def test_complete_refuses_a_completion_past_the_context_before_generating(tiny_model, capsys):
    limit = ModelDir.open(tiny_model, verify=False).config.max_position_embeddings
    argv = ["complete", "--model", str(tiny_model), "--tokens", ",".join(["5"] * (limit - 8)), "--ignore-eos"]
    # Generating would run into the context after 8 tokens and lose them: refused up front, naming the flag.
    rc, out, err = run_cli(capsys, *argv, "--max-new-tokens", "20")
    assert (rc, out) == (2, ""), (rc, out)
    assert err == (
        f"colibri complete: error: --max-new-tokens: prompt ({limit - 8} tokens) + max_new_tokens (20) must be <= "
        f"max_position_embeddings ({limit})\n"
    )
    rc, out, _ = run_cli(capsys, *argv, "--max-new-tokens", "8")
    assert rc == 0 and json.loads(out)["generated_tokens"] == 8


def test_complete_refuses_a_completion_past_the_kv_cache_before_generating(tiny_model, capsys):
    # 2 blocks of 16 tokens hold 32 positions; the last token is sampled, never fed: 3 + 30 would need 32 + 1.
    argv = ["complete", "--model", str(tiny_model), "--tokens", "1,2,3", "--ignore-eos", "--num-kv-blocks", "2"]
    rc, out, err = run_cli(capsys, *argv, "--max-new-tokens", "31")
    assert (rc, out) == (6, ""), (rc, out)
    assert err == (
        "colibri complete: error: --max-new-tokens: prompt (3 tokens) + max_new_tokens (31) need 33 KV positions, "
        "more than the KV cache's 32 (2 blocks of 16 tokens; raise --num-kv-blocks or --kv-cache-tokens)\n"
    )
    rc, out, _ = run_cli(capsys, *argv, "--max-new-tokens", "30")
    assert rc == 0 and json.loads(out)["generated_tokens"] == 30


def test_complete_refuses_a_negative_seed(tiny_model, capsys):
    argv = ["--tokens", "1,2", "--temperature", "1", "--seed", "-1"]
    rc, out, err = run_cli(capsys, "complete", "--model", str(tiny_model), *argv)
    assert (rc, out, err) == (2, "", f"colibri complete: error: --seed: must be in [0, {(1 << 64) - 1}], got -1\n")


def test_make_tiny_refuses_a_negative_seed_before_writing(tmp_path, capsys):
    rc, out, err = run_cli(capsys, "make-tiny", str(tmp_path / "m"), "--seed", "-1", "--no-progress")
    assert (rc, out, err) == (2, "", "colibri make-tiny: error: --seed: must be >= 0, got -1\n")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("command", ["logits", "complete"])
def test_routing_lut_is_refused_offline_naming_the_flag(tiny_model, tmp_path, capsys, command):
    """lut routes each token by the router's plan, and the offline tools have no router: they were told to start one
    with --routing-table, after loading the model."""
    rest = ["--out", str(tmp_path / "l.npy")] if command == "logits" else ["--max-new-tokens", "1"]
    rc, out, err = run_cli(capsys, command, "--model", str(tiny_model), "--tokens", "1,2", "--routing", "lut", *rest)
    assert (rc, out) == (2, "") and err.count("\n") == 1, (rc, out, err)
    assert err.startswith(f"colibri {command}: error: routing: lut takes the routing plan the router sends"), err
    assert "--routing exact" in err and not (tmp_path / "l.npy").exists()
