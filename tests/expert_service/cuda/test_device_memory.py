"""The start-up device-memory check: the plan against the device's free memory (monkeypatched without a GPU), refused
in one line naming the settings; an out-of-memory error raised while the engine loads or warms up anyway (shaped as
numba-cuda 0.30.4 raises it) turned into the same kind of line; every other error passing unchanged. On a GPU: a
worker asked for a KV cache larger than any GPU exits 2 with that line, and a real failed allocation is translated."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from cuda.bindings import driver as drv

import expert_service.cuda.decoder as decoder_module
import expert_service.cuda.device_memory as device_memory
from common.errors import ConfigError
from common.model_format import ModelDir
from common.model_manifest import DENSE_FILE
from expert_service.cuda.cublas import CublasError
from expert_service.cuda.decoder import CudaDecoder
from expert_service.cuda.device_memory import (
    DeviceMemory,
    check_device_memory,
    gib,
    is_out_of_memory,
    plan_device_memory,
)
from expert_service.cuda.driver import CudaDriverError
from expert_service.engine.config import EngineConfig
from expert_service.engine.cuda_options import CudaOptions
from expert_service.experts.slots import plan_slots

GIB = 2**30
H100 = DeviceMemory("NVIDIA H100 80GB HBM3", 70 * GIB, 80 * GIB)
REPO = Path(__file__).resolve().parents[3]
HUGE_KV_TOKENS = 2**30  # 512 GiB of the tiny model's KV cache (2 layers x 2 kv heads x 16 x fp32, K and V)


class CudaAPIError(RuntimeError):
    """numba-cuda 0.30.4's numba.cuda.cudadrv.driver.CudaAPIError, which the simulator these tests run in replaces
    with a stub (test_numba_cudas_own_error_is_recognised raises the real one)."""

    def __init__(self, code, msg):
        self.code = code
        self.msg = msg
        super().__init__(code, msg)

    def __str__(self):
        return f"[{self.code}] {self.msg}"


def numba_error(code=drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY, call="cuMemAlloc") -> CudaAPIError:
    """A failed driver call as numba-cuda 0.30.4 raises it (cudadrv/driver.py, _check_cuda_python_error)."""
    return CudaAPIError(code, f"Call to {call} results in {code.name}")


@pytest.fixture(scope="module")
def model(tiny_model) -> ModelDir:
    return ModelDir.open(tiny_model, verify=False)


@pytest.fixture
def h100(monkeypatch):
    monkeypatch.setattr(device_memory, "read_device_memory", lambda: H100)


def _check(model, **settings):
    config = EngineConfig(backend="cuda", **settings)
    return check_device_memory(model, config, plan_slots(model, config.expert_cache_gb, config.expert_cache_slots))


def _refusal(model, **settings) -> str:
    with pytest.raises(ConfigError) as refused:
        _check(model, **settings)
    message = str(refused.value)
    assert "\n" not in message and refused.value.exit_code == 2
    return message


def test_a_kv_cache_larger_than_free_memory_is_refused_naming_it(model, h100):
    message = _refusal(model, kv_cache_tokens=HUGE_KV_TOKENS)
    assert re.match(r"device out of memory: the plan needs 512\.\d GiB \(dense weights ", message), message
    assert "KV cache 512.0 (kv_cache_tokens 1073741824)" in message
    assert "and NVIDIA H100 80GB HBM3 has 70.0 of 80.0 GiB free; largest first: lower kv_cache_tokens, " in message


def test_num_kv_blocks_is_named_where_it_sizes_the_pool(model, h100):
    message = _refusal(model, num_kv_blocks=2**28, kv_block_size=4)
    assert "KV cache 512.0 (num_kv_blocks 268435456 of 4 tokens)" in message
    assert "largest first: lower num_kv_blocks, " in message and "kv_cache_tokens" not in message


def test_a_plan_is_refused_only_past_the_free_memory(model, monkeypatch):
    """No margin: what the plan leaves out is left to the translation of a real failure."""
    config = EngineConfig(backend="cuda", kv_cache_tokens=4096)
    slots = plan_slots(model, 0, 0)
    needed = plan_device_memory(model, config, slots, H100).nbytes
    monkeypatch.setattr(device_memory, "read_device_memory", lambda: dataclasses.replace(H100, free=needed))
    assert check_device_memory(model, config, slots).nbytes == needed
    monkeypatch.setattr(device_memory, "read_device_memory", lambda: dataclasses.replace(H100, free=needed - 1))
    with pytest.raises(ConfigError, match="^device out of memory: "):
        check_device_memory(model, config, slots)


def test_the_plan_adds_up_the_weights_experts_kv_and_workspace(model, h100):
    cfg, config = model.config, EngineConfig(backend="cuda", kv_cache_tokens=1000, kv_block_size=16)
    items = {item.name: item.nbytes for item in plan_device_memory(model, config, plan_slots(model, 0, 0), H100).items}
    assert items["dense weights"] == os.path.getsize(model.path / DENSE_FILE)
    assert items["experts"] == sum(cfg.num_experts * model.expert_strides[layer] for layer in cfg.moe_layers)
    blocks = math.ceil(1000 / 16)  # K and V, each [layers, blocks, 16, kv heads, head_dim] fp32
    assert items["KV cache"] == 2 * cfg.num_hidden_layers * blocks * 16 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert items["workspace"] > 0


def test_an_expert_cache_is_planned_as_its_slots_and_named(model, monkeypatch):
    config = EngineConfig(backend="cuda", expert_cache_slots=2, kv_cache_tokens=64, max_batch_tokens=16)
    slots = plan_slots(model, config.expert_cache_gb, config.expert_cache_slots)
    plan = plan_device_memory(model, config, slots, H100)
    expert_slots = {item.name: item.nbytes for item in plan.items}["expert slots"]
    assert expert_slots == 2 * slots.slot_row_bytes
    dense = os.path.getsize(model.path / DENSE_FILE)  # room for the weights, not for the slots beside them
    monkeypatch.setattr(device_memory, "read_device_memory", lambda: dataclasses.replace(H100, free=dense + 1024))
    message = _refusal(model, expert_cache_slots=2, kv_cache_tokens=64, max_batch_tokens=16)
    assert f"expert slots {gib(expert_slots)} (expert_cache_slots 2: 2 of 4 experts a layer)" in message
    assert "lower expert_cache_slots" in message


def test_dense_weights_larger_than_free_memory_say_so(model, monkeypatch):
    monkeypatch.setattr(device_memory, "read_device_memory", lambda: dataclasses.replace(H100, free=1024))
    message = _refusal(model, kv_cache_tokens=64)
    assert message.endswith(
        "; the dense weights alone need more than is free: stop other processes on the GPU, or use a larger one"
    )


def test_a_plan_that_fits_is_logged_with_the_free_memory(model, h100, caplog):
    with caplog.at_level(logging.INFO, logger="colibri.worker.cuda"):
        plan = _check(model, kv_cache_tokens=4096)
    [record] = [r for r in caplog.records if r.getMessage().startswith("device memory: ")]
    assert record.getMessage().startswith(
        "device memory: NVIDIA H100 80GB HBM3 has 70.0 of 80.0 GiB free before the load; the plan needs"
    )
    assert (record.free_bytes, record.total_bytes, record.plan_bytes) == (H100.free, H100.total, plan.nbytes)


# --- an out-of-memory error the check did not foresee ----------------------------------------------------------
def _load(model, monkeypatch, allocation_error: BaseException, **settings):
    """CudaDecoder(...) whose first allocation after the weights (the KV pool) raises `allocation_error`."""

    def device_array(*args, **kwargs):
        raise allocation_error

    monkeypatch.setattr(decoder_module, "non_blocking_stream", lambda: (None, None))
    monkeypatch.setattr(decoder_module, "DeviceWeights", lambda *a, **k: SimpleNamespace(dtype=np.dtype(np.float32)))
    monkeypatch.setattr(decoder_module, "cuda", SimpleNamespace(device_array=device_array))
    config = EngineConfig(backend="cuda", **settings)
    return CudaDecoder(model, config, plan_slots(model, 0, 0))


def test_an_out_of_memory_error_while_loading_becomes_one_line(model, h100, monkeypatch):
    error = numba_error()
    with pytest.raises(ConfigError) as refused:
        _load(model, monkeypatch, error, kv_cache_tokens=4096)
    message = str(refused.value)
    assert "\n" not in message and refused.value.__cause__ is error
    assert message.startswith(
        "device out of memory while loading the model (Call to cuMemAlloc results in CUDA_ERROR_OUT_OF_MEMORY): "
        "the plan needs "
    )
    assert "KV cache " in message and "(kv_cache_tokens 4096)" in message
    assert "and NVIDIA H100 80GB HBM3 had 70.0 of 80.0 GiB free before the load; what the plan leaves out" in message
    assert "largest first: lower " in message


@pytest.mark.parametrize(
    "error",
    [ValueError("boom"), numba_error(drv.CUresult.CUDA_ERROR_INVALID_VALUE, "cuMemsetD8Async")],
    ids=["value-error", "other-driver-error"],
)
def test_other_errors_while_loading_pass_unchanged(model, h100, monkeypatch, error):
    with pytest.raises(type(error)) as raised:
        _load(model, monkeypatch, error, kv_cache_tokens=4096)
    assert raised.value is error


def test_an_out_of_memory_error_while_warming_up_becomes_one_line(model, h100):
    config = EngineConfig(backend="cuda", kv_cache_tokens=4096)
    decoder = CudaDecoder.__new__(CudaDecoder)
    decoder.device_plan = plan_device_memory(model, config, plan_slots(model, 0, 0), H100)
    error = CublasError("cublasCreate failed with cuBLAS status 3", 3)

    def warmup(logits):
        raise error

    decoder.penalties, decoder.ws = SimpleNamespace(warmup=warmup), SimpleNamespace(logits=None)
    with pytest.raises(ConfigError, match=r"^device out of memory while warming up \(CublasError: cublasCreate") as e:
        decoder.warmup()
    assert e.value.__cause__ is error


def test_a_decoder_without_a_plan_passes_its_errors_unchanged():
    """Host-only decoders of other tests (made with __new__) have no plan: nothing to translate with."""
    decoder, error = CudaDecoder.__new__(CudaDecoder), numba_error()

    def warmup(logits):
        raise error

    decoder.penalties, decoder.ws = SimpleNamespace(warmup=warmup), SimpleNamespace(logits=None)
    with pytest.raises(CudaAPIError) as raised:
        decoder.warmup()
    assert raised.value is error


def _caused(error: BaseException, cause: BaseException) -> BaseException:
    error.__cause__ = cause
    return error


def _coded(error: Exception, code) -> Exception:
    error.code = code  # type: ignore[attr-defined]
    return error


@pytest.mark.parametrize(
    "error, out_of_memory",
    [
        (numba_error(), True),
        (numba_error(drv.CUresult.CUDA_ERROR_INVALID_VALUE), False),
        (CudaDriverError("CUDA driver error CUDA_ERROR_OUT_OF_MEMORY", drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY), True),
        (CudaDriverError("CUDA driver error CUDA_ERROR_LAUNCH_FAILED", drv.CUresult.CUDA_ERROR_LAUNCH_FAILED), False),
        (CublasError("cublasCreate failed with cuBLAS status 3", 3), True),
        (CublasError("cublasGemmEx failed with cuBLAS status 7", 7), False),
        (RuntimeError("CUDA_ERROR_OUT_OF_MEMORY: out of memory"), True),  # cuda.core's errors name it
        (_caused(ValueError("could not give it"), numba_error()), True),
        (_coded(RuntimeError("another library's error"), 2), False),  # a `code` of the same value, not a CUresult
        (ConfigError("device out of memory: ... CUDA_ERROR_OUT_OF_MEMORY"), False),  # already translated
        (OSError(12, "Cannot allocate memory"), False),  # host memory: not the device's
    ],
)
def test_what_counts_as_the_device_out_of_memory(error, out_of_memory):
    assert is_out_of_memory(error) is out_of_memory


def test_numba_cudas_own_error_is_recognised():
    """The real numba-cuda class, in a process without the simulator (which replaces the module it lives in)."""
    script = textwrap.dedent(
        """
        from cuda.bindings import driver as drv
        from numba.cuda.cudadrv.driver import CudaAPIError
        from expert_service.cuda.device_memory import is_out_of_memory
        R = drv.CUresult
        oom = CudaAPIError(R.CUDA_ERROR_OUT_OF_MEMORY, "Call to cuMemAlloc results in CUDA_ERROR_OUT_OF_MEMORY")
        other = CudaAPIError(R.CUDA_ERROR_INVALID_VALUE, "Call to cuMemcpyHtoD results in CUDA_ERROR_INVALID_VALUE")
        print(type(oom).__module__, is_out_of_memory(oom), is_out_of_memory(other))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.split() == ["numba.cuda.cudadrv.driver", "True", "False"], done.stderr


# --- on a GPU ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_a_worker_asked_for_a_kv_cache_larger_than_the_gpu_exits_2_in_one_line(tiny_model):
    from tests.expert_service.serving.worker_process import worker_env

    command = [sys.executable, "-m", "colibri.cli", "worker", "--model", str(tiny_model), "--backend", "cuda"]
    command += ["--port", "0", "--metrics-port", "0", "--kv-cache-tokens", str(HUGE_KV_TOKENS)]
    done = subprocess.run(command, env=worker_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2, done.stderr
    # 512 GiB of KV cache and a few MiB of the rest (the workspace's strategies depend on the GPU)
    assert re.match(r"colibri worker: error: device out of memory: the plan needs 512\.\d GiB \(", last), last
    assert "KV cache 512.0 (kv_cache_tokens 1073741824)" in last and "lower kv_cache_tokens" in last
    assert "Traceback" not in done.stderr
    assert "worker stopped exit_code=2" in done.stderr


@pytest.mark.gpu
def test_a_real_failed_allocation_while_loading_becomes_one_line(tiny_model, monkeypatch):
    """The check told the device has room it has not: the KV pool's real cuMemAlloc fails and is translated."""
    from expert_service.backends import build_engine

    measured = device_memory.read_device_memory()
    monkeypatch.setattr(device_memory, "read_device_memory", lambda: dataclasses.replace(measured, free=2**50))
    config = EngineConfig(backend="cuda", kv_cache_tokens=HUGE_KV_TOKENS)
    with pytest.raises(ConfigError) as refused:
        build_engine(ModelDir.open(tiny_model, verify=False), config)
    message = str(refused.value)
    assert message.startswith("device out of memory while loading the model (") and "\n" not in message
    assert "CUDA_ERROR_OUT_OF_MEMORY" in message and "(kv_cache_tokens 1073741824)" in message
    assert is_out_of_memory(refused.value.__cause__)


def allocated_arrays(device) -> list:
    """The device arrays an object holds (its own allocations: views of others' are not kept on these objects)."""
    return [v for v in vars(device).values() if hasattr(v, "copy_to_host")]


@pytest.mark.parametrize("vocab", [259, 272], ids=["stream", "mma"])
def test_an_8bit_heads_device_buffers_are_planned_with_the_workspace(tmp_path, vocab):
    """The 8-bit head's launch tables and bf16 rows (EightBitRows over max_batch_size rows; the GEMM's only where
    the vocabulary takes it) are allocated beside the workspace: the plan counts exactly what it allocates."""
    from numba import cuda

    from expert_service.cuda.linear_8bit import EightBitRows, takes_mma
    from expert_service.tools.convert import convert
    from tests.expert_service.tools.head_checkpoint import head_config, write_head_checkpoint

    write_head_checkpoint(tmp_path / "hf", head_config("mixtral", vocab_size=vocab))
    eight_bit = ModelDir.open(convert(tmp_path / "hf", tmp_path / "m8", "bfloat16", False, head_dtype="int8"))
    plain = ModelDir.open(convert(tmp_path / "hf", tmp_path / "plain", "bfloat16", False))
    config, rows, D = EngineConfig(backend="cuda", kv_cache_tokens=256, max_batch_size=12), 12, plain.config.hidden_size

    def workspace(model: ModelDir) -> int:
        plan = plan_device_memory(model, config, plan_slots(model, 0, 0), H100)
        return {item.name: item.nbytes for item in plan.items}["workspace"]

    mma = takes_mma(vocab, eight_bit.head_format.nbytes)
    assert mma == (vocab % 16 == 0)
    planned = EightBitRows.planned_nbytes(rows, D, mma)
    assert workspace(eight_bit) - workspace(plain) == planned
    device = EightBitRows(rows, D, mma, cuda.default_stream())
    allocated = allocated_arrays(device)
    assert len(allocated) == (5 if mma else 1) and sum(a.nbytes for a in allocated) == planned == device.nbytes


def test_8bit_attentions_device_buffers_are_planned_with_the_workspace(tmp_path):
    """8-bit attention projections' launch tables and bf16 rows (as wide as the widest input, q_size or hidden_size,
    for max_batch_tokens rows) and the scratch their large steps widen each projection into (q_size x hidden_size
    in the dense dtype): allocated beside the workspace and counted exactly."""
    from numba import cuda

    from expert_service.cuda.attention_8bit import DeviceAttention8Bit
    from expert_service.cuda.weights import DeviceWeights
    from expert_service.tools.convert import convert
    from tests.expert_service.tools.head_checkpoint import head_config, write_head_checkpoint

    write_head_checkpoint(tmp_path / "hf", head_config("qwen3_moe"))
    eight_bit = ModelDir.open(convert(tmp_path / "hf", tmp_path / "m8", "bfloat16", False, attention_dtype="int8"))
    plain = ModelDir.open(convert(tmp_path / "hf", tmp_path / "plain", "bfloat16", False))
    config = EngineConfig(backend="cuda", kv_cache_tokens=256, max_batch_size=12, max_batch_tokens=200)
    cfg = plain.config

    def workspace(model: ModelDir) -> int:
        plan = plan_device_memory(model, config, plan_slots(model, 0, 0), H100)
        item = {item.name: item for item in plan.items}["workspace"]
        # the remedy names the widening scratch where there is one
        scratch = model is eight_bit and 0 < config.cuda_options.attention_8bit_dense_rows <= 200
        assert ("attention_8bit_dense_rows 0" in item.remedy) == scratch, item.remedy
        return item.nbytes

    dense_rows = 32  # widens steps of this engine
    config = dataclasses.replace(config, cuda_options=CudaOptions(attention_8bit_dense_rows=dense_rows))
    planned = DeviceAttention8Bit.planned_nbytes(cfg.hidden_size, cfg.q_size, 200, np.uint16, dense_rows)
    assert workspace(eight_bit) - workspace(plain) == planned
    weights = DeviceWeights(eight_bit, cuda.default_stream(), use_pinned_memory=False)
    device = DeviceAttention8Bit(weights.attention_8bit, weights, 200, cuda.default_stream(), dense_rows=dense_rows)
    allocated = allocated_arrays(device.rows)
    assert len(allocated) == 7 and sum(a.nbytes for a in allocated) == planned == device.rows.nbytes
    assert device.rows.rows_bf16.size == device.rows.sorted_ids.size * max(cfg.hidden_size, cfg.q_size)
    assert device.rows.widened.size == cfg.q_size * cfg.hidden_size and device.rows.widened.dtype == np.uint16
    for never in (0, 201):  # no widening within the engine's steps: no scratch, planned or allocated
        config = dataclasses.replace(config, cuda_options=CudaOptions(attention_8bit_dense_rows=never))
        planned = DeviceAttention8Bit.planned_nbytes(cfg.hidden_size, cfg.q_size, 200, np.uint16, never)
        assert workspace(eight_bit) - workspace(plain) == planned
        device = DeviceAttention8Bit(weights.attention_8bit, weights, 200, cuda.default_stream(), dense_rows=never)
        assert device.rows.widened is None and device.rows.nbytes == planned
    weights.close()
