"""Fixtures of the bench tests: the tiny model with a router-gen table and a prompt text, and one
bench/offload.py run of it (shared by the offload and report tests)."""

from __future__ import annotations

import pytest

from bench import offload
from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.tools.routing_gen import load_corpus, run_router_gen
from training.corpus import DATA_DIR

HELDOUT_TEXT = (DATA_DIR / "heldout.txt").read_text(encoding="utf-8")


def text_file(path, start: int, chars: int):
    path.write_text(HELDOUT_TEXT[start : start + chars], encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def model_with_table(tiny_model, tmp_path_factory):
    """The tiny model, a table router-gen built from one part of the held-out books (cpu, with its counts file),
    and a prompt text from another part."""
    work = tmp_path_factory.mktemp("offload-model")
    model = ModelDir.open(tiny_model, verify=False)
    corpus_path = text_file(work / "corpus.txt", 100_000, 6_000)
    corpus = load_corpus(corpus_path, "text", model)
    table = work / "table.bin"
    run_router_gen(
        model,
        lambda: build_engine(model, EngineConfig(backend="cpu", max_batch_tokens=4096)),
        corpus,
        str(corpus_path),
        table,
        model.config.num_experts_per_tok,
        0.1,
        256,
        save_counts=True,
    )
    return model, table, text_file(work / "prompts.txt", 20_000, 3_000)


@pytest.fixture(scope="session")
def offload_run(model_with_table, tmp_path_factory):
    """One bench run of the model at 50 % with prefetch none and plan; (out dir, every prefilled chunk's ids)."""
    model, table_path, prompts = model_with_table
    tmp = tmp_path_factory.mktemp("offload-run")
    prefilled = []
    make_engine = offload.make_engine

    def recording_engine(*args, **kwargs):
        engine = make_engine(*args, **kwargs)
        step = engine.step

        def spy(prefill=(), decode_ids=(), routing_plan=None):
            prefilled.extend(p.token_ids for p in prefill)
            return step(prefill, decode_ids, routing_plan)

        engine.step = spy
        return engine

    out = tmp / "out"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(offload, "make_engine", recording_engine)
        assert (
            offload.main(
                [
                    "--model",
                    str(model.path),
                    "--prompts",
                    str(prompts),
                    "--table",
                    str(table_path),
                    "--skip-hf",
                    "--backend",
                    "cpu",
                    "--fractions",
                    "0.5",
                    "--prefetch-modes",
                    "none,plan",
                    "--decode-steps",
                    "3",
                    "--out",
                    str(out),
                    "--workdir",
                    str(tmp / "work"),
                ]
            )
            == 0
        )
    return out, prefilled
