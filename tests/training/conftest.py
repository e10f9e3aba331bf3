"""The shipped default model (training/default-model-hf), converted once per session."""

from pathlib import Path

import pytest

DEFAULT_MODEL_HF = Path(__file__).resolve().parents[2] / "training" / "default-model-hf"


@pytest.fixture(scope="session")
def default_model_bf16(tmp_path_factory) -> Path:
    """What `colibri convert training/default-model-hf DIR --dtype bfloat16` writes."""
    from expert_service.tools.convert import convert

    return convert(DEFAULT_MODEL_HF, tmp_path_factory.mktemp("default-bf16"), dtype="bfloat16", progress=False)


@pytest.fixture(scope="session")
def default_model_fp32(tmp_path_factory) -> Path:
    from expert_service.tools.convert import convert

    return convert(DEFAULT_MODEL_HF, tmp_path_factory.mktemp("default-fp32"), dtype="float32", progress=False)


@pytest.fixture(scope="session")
def heldout_ids():
    """The held-out books, tokenised as a prompt is (with <s>)."""
    from tokenizers import Tokenizer

    from training.corpus import DATA_DIR

    tokenizer = Tokenizer.from_file(str(DEFAULT_MODEL_HF / "tokenizer.json"))
    return tokenizer.encode((DATA_DIR / "heldout.txt").read_text(encoding="utf-8")).ids
