"""bench/serve.py --workload prefix end to end on the tiny model with the cpu backend (tiny sizes): the worker,
a router with prefix caching on and off, every workload; the JSON has every ratio, finite and positive, and the
shared workload's prompts were served from the cache with it on only. No timing assertions."""

from __future__ import annotations

import json
import math

import pytest

from bench import serve

pytestmark = pytest.mark.slow


def test_serve_prefix_bench_tiny_cpu(tmp_path):
    args = ["--workload", "prefix", "--backend", "cpu", "--clients", "3", "--rounds", "1", "--system-tokens", "32"]
    args += ["--user-tokens", "4", "--new-tokens", "2", "--out", str(tmp_path), "--name", "prefix"]
    args += ["--cuda-options", '{"decode_splits_per_step": true}']  # through a worker --config file
    assert serve.main(args) == 0
    results = json.loads((tmp_path / "prefix.json").read_text())
    assert results["cuda_options"] == {"decode_splits_per_step": True}
    assert results["expert_dtype"] == "bfloat16"  # the cpu's tiny model: no conversion
    entry = results["models"]["tiny"]
    assert set(entry["ratios"]) == {
        f"{w}_{m}_on_x_off" for w in ("shared", "unshared", "multiturn") for m in ("ttft_p50", "throughput")
    }
    assert all(math.isfinite(v) and v > 0 for v in entry["ratios"].values())
    assert entry["on"]["shared"]["cached_prompt_share"] > 0.5 and entry["off"]["shared"]["cached_prompt_share"] == 0
    assert entry["on"]["unshared"]["cached_prompt_share"] == 0
    assert len(entry["on"]["shared"]["rounds"]) == 2  # one measured round in each of the two passes
    assert entry["on"]["shared"]["prefill_steps"] >= 2 and entry["off"]["unshared"]["prefill_steps"] >= 1
    assert (tmp_path / "prefix.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="only 'prefix'"):
        serve.main(["--workload", "other"])


def test_cuda_options_reach_the_worker_as_a_config_file(tmp_path):
    from bench.serve_services import cuda_options_file, worker_command

    cfg = dict(backend="cuda", kv_block_size=16, kv_cache_tokens=64, max_batch_tokens=64, max_batch_size=4)
    cfg["max_concurrent_requests"] = 8
    assert "--config" not in worker_command(tmp_path, {**cfg, "config_file": cuda_options_file({}, tmp_path)}, 1)
    path = cuda_options_file({"wgmma_experts": False}, tmp_path)
    command = worker_command(tmp_path, {**cfg, "config_file": path}, 1)
    assert command[command.index("--config") + 1] == path
    assert json.loads(open(path).read())["engine"] == {"cuda_options": {"wgmma_experts": False}}
    with pytest.raises(SystemExit):
        serve.main(["--workload", "prefix", "--cuda-options", '{"wgmma_experts": 3}'])


def test_expert_dtype_reaches_the_conversion_of_the_built_models(tmp_path, monkeypatch):
    """--expert-dtype converts the cuda models' experts (the decode steps both sides share then read 8-bit experts);
    an unknown dtype is refused."""
    import sys
    import types

    import bench.engine
    from bench.serve_services import prepare_models

    converted = []
    monkeypatch.setattr(bench.engine, "build_hf", lambda family, params: object())
    monkeypatch.setattr(
        bench.engine, "write_colibri", lambda hf, out, expert_dtype=None: converted.append(expert_dtype) or out
    )
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(empty_cache=lambda: None))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    for dtype in ("int8", None):
        args = types.SimpleNamespace(model=None, backend="cuda", shapes="mixtral-shape", expert_dtype=dtype)
        assert [name for name, _ in prepare_models(args, tmp_path)] == ["mixtral-shape"]
    assert converted == ["int8", None]
    with pytest.raises(SystemExit):
        serve.main(["--workload", "prefix", "--expert-dtype", "int4"])
