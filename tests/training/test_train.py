"""The training script end to end on the CPU with the tiny preset: the loss falls and the output is a Hugging
Face checkpoint that transformers loads and Colibri converts."""

import json
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from training.corpus import DATA_DIR, read_chapters, write_chapters  # noqa: E402
from training.model import PRESETS, parameter_count  # noqa: E402
from training.train import RunConfig, load_balancing_loss, train  # noqa: E402

CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "training_log.json",
)


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    # 45 short chapters: enough for a validation chapter (every 40th) and held-out books at the end.
    chapters = [replace(c, text=c.text[:600]) for c in read_chapters(DATA_DIR / "heldout.txt")[:45]]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    write_chapters(chapters, path)
    return path


@pytest.mark.slow  # about 30 s of training
def test_tiny_training_lowers_the_loss_and_writes_a_checkpoint(small_corpus, tmp_path):
    log = train(RunConfig(preset="tiny", corpus=small_corpus, out=tmp_path, device="cpu", steps=30, samples=False))
    curve = log["curve"]
    assert curve[-1]["train_ce"] < curve[0]["train_ce"] - 0.5, curve
    assert log["evals"][-1]["validation_ce"] < log["evals"][0]["validation_ce"]
    assert all((tmp_path / name).is_file() for name in CHECKPOINT_FILES)
    assert json.loads((tmp_path / "training_log.json").read_text())["steps"] == 30
    assert len(log["expert_load_heldout"]) == PRESETS["tiny"].num_layers

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.config.num_local_experts == PRESETS["tiny"].num_experts
    assert sum(p.numel() for p in model.parameters()) == parameter_count(PRESETS["tiny"], log["vocab_size"])["total"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer("In the beginning").input_ids[0] == tokenizer.bos_token_id == 1

    from common.model_format import ModelDir
    from expert_service.tools.convert import convert

    converted = ModelDir.open(convert(tmp_path, tmp_path / "colibri", dtype="bfloat16", progress=False))
    assert converted.config.num_experts == PRESETS["tiny"].num_experts


def test_load_balancing_loss_is_one_when_balanced_and_sees_a_collapsed_layer():
    balanced = torch.zeros(8, 4)  # uniform probabilities; top-2 ties -> experts 0, 1
    assert float(load_balancing_loss((balanced,), 2)) == pytest.approx(1.0)
    collapsed = torch.tensor([[9.0, 9.0, 0.0, 0.0]] * 8)
    other_half = torch.tensor([[0.0, 0.0, 9.0, 9.0]] * 8)
    # Pooled over both layers this routing is even; per layer each sends everything to half the experts.
    assert float(load_balancing_loss((collapsed, other_half), 2)) == pytest.approx(2.0, rel=1e-3)
