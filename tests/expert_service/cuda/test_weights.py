"""HostUploader's page-locking lifetime (CPU: the driver calls are replaced by recorders)."""

import gc

import numpy as np
import pytest
from numba import cuda

import expert_service.cuda.weights as weights


def recorders(monkeypatch):
    pinned, unpinned = [], []
    monkeypatch.setattr(weights, "pin_readonly", lambda host, mapped=False: pinned.append(host.ctypes.data) or True)
    monkeypatch.setattr(weights, "unpin", lambda host: unpinned.append(host.ctypes.data))
    return pinned, unpinned


def test_release_unpins_every_pinned_range_once(monkeypatch):
    pinned, unpinned = recorders(monkeypatch)
    uploader = weights.HostUploader(stream=None)
    hosts = [np.random.default_rng(i).integers(0, 255, 64, dtype=np.uint8) for i in range(3)]
    assert all(uploader.pin(h) for h in hosts)
    uploader.release()
    uploader.release()
    assert sorted(unpinned) == sorted(pinned) and len(unpinned) == 3


def test_an_uploader_dropped_without_release_still_unpins(monkeypatch):
    """A registration that outlives its mmap makes the driver refuse later allocations at those addresses."""
    pinned, unpinned = recorders(monkeypatch)
    uploader = weights.HostUploader(stream=None)
    uploader.pin(np.arange(32, dtype=np.uint8))
    del uploader
    gc.collect()
    assert unpinned == pinned and len(pinned) == 1


def test_refused_ranges_are_not_unpinned(monkeypatch):
    pinned, unpinned = recorders(monkeypatch)
    monkeypatch.setattr(weights, "pin_readonly", lambda host, mapped=False: False)
    uploader = weights.HostUploader(stream=None)
    assert not uploader.pin(np.arange(32, dtype=np.uint8))
    uploader.release()
    assert unpinned == []


def test_q_k_v_stored_back_to_back_stack_into_one_matrix():
    """The format writes q, k, v projections consecutively: one [q_size + 2 kv_size, D] view serves a one-token
    step's single GEMV. Biases whose sizes break the 64-byte alignment are padded apart: no stacked view."""
    from common.model_manifest import plan_layout
    from common.models import config_from_hf
    from expert_service.tools.tiny_model import tiny_hf_config

    for family, dtype in (("qwen3_moe", "bfloat16"), ("qwen2_moe", "float32"), ("mixtral", "float16")):
        config = config_from_hf(tiny_hf_config(family))
        entries, _ = plan_layout(config, dtype)
        parts = [entries[f"layers.1.{p}_proj"] for p in "qkv"]
        offset, nbytes, got_dtype, shape = weights.stacked_range(parts)
        assert (offset, nbytes, got_dtype) == (parts[0].offset, sum(p.nbytes for p in parts), dtype)
        assert shape == (config.q_size + 2 * config.kv_size, config.hidden_size)
    config = config_from_hf(tiny_hf_config("qwen2_moe"))
    entries, _ = plan_layout(config, "bfloat16")
    biases = [entries[f"layers.0.{p}_bias"] for p in "qkv"]
    padded = any(a.offset + a.nbytes != b.offset for a, b in zip(biases, biases[1:]))
    assert (weights.stacked_range(biases) is None) == padded
    assert weights.stacked_range([entries["layers.0.q_proj"], entries["layers.0.o_proj"]]) is None  # rows differ
    assert weights.stacked_range([entries["layers.0.k_proj"], entries["layers.0.q_proj"]]) is None  # out of order
    assert weights.stacked_range([entries["layers.0.q_proj"], None]) is None


def test_expert_facts_come_from_the_model_directory_alone(tiny_model, tmp_path):
    """What DeviceWeights takes, and the device-memory check lays the workspace out with, before any upload."""
    from common.model_format import ModelDir
    from expert_service.kernels import expert_quant
    from expert_service.tools.tiny_model import make_tiny

    plain = weights.expert_facts(ModelDir.open(tiny_model, verify=False), resident=True)
    assert (plain.dtype, plain.quantized, plain.all_8bit, plain.meta, plain.kinds) == (np.float32, False, False, {}, {})
    model = ModelDir.open(make_tiny(tmp_path / "int8", expert_dtype="int8"), verify=False)
    facts = weights.expert_facts(model, resident=False)
    assert facts.quantized and facts.all_8bit and not facts.w8a8_layers  # behind the expert cache: never W8A8
    assert sorted(facts.meta) == sorted(facts.kinds) == model.config.moe_layers
    for layer in model.config.moe_layers:
        np.testing.assert_array_equal(facts.meta[layer], weights.expert_meta(model, layer))
        assert facts.kinds[layer] == expert_quant.layer_kinds(facts.meta[layer])


def test_an_8bit_head_the_cuda_kernels_cannot_run_is_one_config_line(tmp_path):
    """hidden_size not a multiple of 16: linear_q8's rows are whole 16-byte chunks. The worker prints a ConfigError
    in one line; any other exception would be a traceback."""
    from common.errors import ConfigError
    from common.model_format import ModelDir
    from expert_service.tools.convert import convert
    from tests.expert_service.tools.head_checkpoint import head_config, write_head_checkpoint

    hf_config = head_config("mixtral", hidden_size=40, num_attention_heads=4, num_key_value_heads=2)
    write_head_checkpoint(tmp_path / "hf", hf_config)
    model = ModelDir.open(convert(tmp_path / "hf", tmp_path / "m", "bfloat16", False, head_dtype="int8"))
    message = (
        r"^backend: the cuda backend runs an 8-bit lm_head only with hidden_size a multiple of 16, and \S+ has int8 "
        r"lm_head with hidden_size 40; convert with --head-dtype bfloat16, or use --backend cpu$"
    )
    for resident in (True, False):
        with pytest.raises(ConfigError, match=message):
            weights.expert_facts(model, resident=resident)
    plain = ModelDir.open(convert(tmp_path / "hf", tmp_path / "plain", "bfloat16", False))
    weights.check_head_for_cuda(plain)  # a dense head runs at any size


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_8bit_attention_projections_are_read_through_their_meta_rows(tmp_path, monkeypatch, dtype):
    """Each layer's q|k|v, q, k, v and o as the kernels read them (the meta row's matrix and scale offsets into
    the uploaded block) are the model directory's codes and scales, byte for byte; no dense "qkv_proj" view of
    the codes is made (simulator: the upload is a copy)."""
    from common.model_format import ModelDir
    from expert_service.tools.convert import convert
    from tests.expert_service.tools.head_checkpoint import head_config, write_head_checkpoint

    recorders(monkeypatch)
    write_head_checkpoint(tmp_path / "hf", head_config("qwen3_moe"))
    model = ModelDir.open(convert(tmp_path / "hf", tmp_path / dtype, "bfloat16", False, attention_dtype=dtype))
    device = weights.DeviceWeights(model, stream=cuda.default_stream())
    cfg = model.config
    D, nq, nkv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    assert len(device.attention_8bit) == cfg.num_hidden_layers
    for i, layer in enumerate(device.attention_8bit):
        assert device.layer(i, "qkv_proj") is None
        names = {
            "q": ["q_proj"],
            "k": ["k_proj"],
            "v": ["v_proj"],
            "o": ["o_proj"],
            "qkv": ["q_proj", "k_proj", "v_proj"],
        }
        for field, parts in names.items():
            matrix = getattr(layer, field)
            block, meta = matrix.block.copy_to_host(), matrix.meta.copy_to_host()[0]
            rows, cols = matrix.n_out, matrix.n_in
            codes = block[meta[4] : meta[4] + rows * cols]
            scales = block[meta[7] : meta[7] + 4 * rows].view(np.float32)
            want = [model.raw_bytes(f"layers.{i}.{p}").reshape(-1) for p in parts]
            want_scales = [model.tensor(f"layers.{i}.{p}_scale") for p in parts]
            np.testing.assert_array_equal(codes, np.concatenate(want), err_msg=f"layer {i} {field}")
            np.testing.assert_array_equal(scales, np.concatenate(want_scales), err_msg=f"layer {i} {field}")
            assert (rows, cols) == {"q": (nq, D), "k": (nkv, D), "v": (nkv, D), "o": (D, nq), "qkv": (nq + 2 * nkv, D)}[
                field
            ]
    device.close()
