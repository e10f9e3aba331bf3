"""bench/engine.py without a GPU: its random models per expert dtype, its served decode (a StepPump, two steps in
flight) on the cpu backend, and main's --skip-hf run over every dtype with the engine measurement stubbed (the
JSON, the ratios to bf16 and the figure)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from bench import engine as bench
from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig
from expert_service.engine.engine import PrefillInput
from expert_service.engine.sampling import SamplingParams
from expert_service.serving.lifecycle import ModelThread

# the reference shapes' structure (experts, top-k, families) at toy sizes
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256}
SMALL_QWEN = {"moe_intermediate_size": 32, "head_dim": 16, "num_experts": 16}
FORMATS = {"bfloat16": ["bfloat16"], "int8": ["int8"], "fp8": ["float8_e4m3fn/block128"]}
# the runs with the LM head in the experts' 8 bits too: (expert formats, head dtype)
HEAD_RUNS = {"int8+head": (["int8"], "int8"), "fp8+head": (["float8_e4m3fn/block128"], "float8_e4m3fn")}
# and with the attention projections too: (expert formats, head and attention dtype)
ATTENTION_RUNS = {"int8+head+attn": (["int8"], "int8"), "fp8+head+attn": (["float8_e4m3fn/block128"], "float8_e4m3fn")}


def small_shapes() -> dict:
    shapes = {}
    for name, (family, params) in bench.SHAPES.items():
        small = {**params, **SMALL, "num_attention_heads": 4, "num_key_value_heads": 2}
        shapes[name] = (family, small | (SMALL_QWEN if "moe_intermediate_size" in params else {}))
    return shapes


@pytest.mark.parametrize("name", list(bench.SHAPES))
def test_random_model_per_expert_dtype(tmp_path, name):
    family, params = small_shapes()[name]
    for dtype, formats in FORMATS.items():
        model = ModelDir.open(bench.random_model(family, params, tmp_path / name, dtype))  # checks every crc32
        assert list(model.expert_formats) == formats
        assert model.config.num_experts == params.get("num_experts", params.get("num_local_experts"))
        assert model.head_format is None
    for dtype, (formats, head) in HEAD_RUNS.items():
        model = ModelDir.open(bench.random_model(family, params, tmp_path / name, dtype))
        assert list(model.expert_formats) == formats and model.head_format.dtype == head
        assert model.entries["embed_tokens"].dtype == "bfloat16"
        values = model.tensor_f32("lm_head")  # small and finite, as the bf16 weights around it
        assert np.isfinite(values).all() and 0 < np.abs(values).max() < 0.1
        assert model.attention_format is None
    for dtype, (formats, eight_bit) in ATTENTION_RUNS.items():
        model = ModelDir.open(bench.random_model(family, params, tmp_path / name, dtype))
        assert list(model.expert_formats) == formats
        assert model.head_format.dtype == model.attention_format.dtype == eight_bit
        for p in ("q_proj", "o_proj"):
            values = model.tensor_f32(f"layers.1.{p}")
            assert np.isfinite(values).all() and 0 < np.abs(values).max() < 0.1, (dtype, p)


def test_pipelined_decode_serves_two_steps_in_flight_on_the_cpu_backend(tiny_model, monkeypatch):
    monkeypatch.setattr(bench, "DECODE_STEPS", 3)
    model = ModelDir.open(tiny_model, verify=False)
    engine = build_engine(model, EngineConfig(backend="cpu", kv_block_size=16, kv_cache_tokens=1024))
    ids = [0, 1]
    rng = np.random.default_rng(0)
    engine.step([PrefillInput(i, rng.integers(0, model.config.vocab_size, 8), SamplingParams(), True) for i in ids])
    contexts = []
    thread = ModelThread("test-bench-engine")
    try:
        seconds, moved = bench.pipelined_decode(
            engine, ids, thread, lambda result, context: contexts.append(context) or context
        )
    finally:
        thread.shutdown()
    assert seconds > 0 and moved == np.median(contexts)  # the median of what step_bytes gave
    assert contexts == [16 + (5 + i) * 2 for i in range(3)]  # 8 prompt tokens each, then a token a step
    assert [engine.sequences[i].num_cached for i in ids] == [8 + 6 + 3] * 2  # every step sent was collected


def test_main_skip_hf_runs_every_shape_and_dtype(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setattr(bench, "SHAPES", small_shapes())
    measured, heads = [], []

    def fake_colibri(model_dir, vocab, cuda_options, hbm_bytes_per_s):
        model = ModelDir.open(model_dir, verify=False)
        measured.append((model_dir.name, list(model.expert_formats), cuda_options))
        heads.append(model.head_format and model.head_format.dtype)
        assert hbm_bytes_per_s == 3.35e12  # --hbm-bytes-per-s, over the H200 reference the simulator falls back to
        scale = 2.0 if list(model.expert_formats) == ["bfloat16"] else 1.0  # 8-bit: twice as fast
        return {
            "prefill_tok_s": {f"{b}x{n}": 100.0 / scale for b, n in bench.PREFILL},
            "decode_ms": {str(b): scale for b in bench.DECODE_BATCHES},
        }

    monkeypatch.setattr(bench, "bench_colibri", fake_colibri)
    out = tmp_path / "out"
    argv = ["--out", str(out), "--workdir", str(tmp_path / "work"), "--shapes", "mixtral-shape,qwen3moe-shape"]
    argv += ["--expert-dtype", "bfloat16,int8,fp8,int8+head", "--skip-hf", "--cuda-options", '{"cached_gemv": false}']
    argv += ["--hbm-bytes-per-s", "3.35e12"]
    monkeypatch.setattr(sys, "argv", ["engine.py", *argv])
    assert bench.main() == 0
    runs = [*FORMATS.items(), ("int8+head", ["int8"])]
    assert [(name.split("-")[-1], formats) for name, formats, _ in measured] == runs * 2
    assert heads == [None, None, None, "int8"] * 2
    assert all(options == {"cached_gemv": False} for _, _, options in measured)
    result = json.loads((out / "engine.json").read_text())
    assert result["expert_dtypes"] == ["bfloat16", "int8", "fp8", "int8+head"]
    assert result["cuda_options"] == {"cached_gemv": False}
    assert result["hbm_bytes_per_s"] == 3.35e12 and result["hbm_bytes_per_s_h200_reference"] == 4.3e12
    assert result["device"] == "simulator" and result["hbm_read_bytes_per_s_measured"] is None
    for entry in result["shapes"].values():
        assert entry["hf"] is None and list(entry["colibri_by_expert_dtype"]) == [
            "bfloat16",
            "int8",
            "fp8",
            "int8+head",
        ]
        ratios = entry["expert_dtype_ratios"]
        assert ratios["decode_b1_int8_x_bfloat16"] == ratios["decode_b64_fp8_x_bfloat16"] == 2.0
        assert ratios["prefill_1x512_fp8_x_bfloat16"] == ratios["decode_b1_int8+head_x_bfloat16"] == 2.0
    if bench.pyplot() is not None:
        assert (out / "engine.png").stat().st_size > 0
    assert not any((tmp_path / "work").glob("*/*"))  # each model removed after its run


def test_cuda_options_are_refused_in_one_line(capsys):
    parser = bench.argparse.ArgumentParser()
    with pytest.raises(SystemExit):
        bench.cuda_options_arg(parser, '{"no_such_option": true}')
    assert "--cuda-options" in capsys.readouterr().err
