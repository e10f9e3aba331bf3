"""L2 prefetch of a decode step's weights (cuda/l2_warm.py, kernels/l2_prefetch.py).

No GPU: the tables point at exactly the bytes of the weights the next kernels read (o, the router, the next layer's
q|k|v; dense and 8-bit projections), the expert span fits the budget, and the kernel's pieces cover each range and
picked block exactly once (the simulator records them). GPU: decode with the option on gives the tokens and
logits of decode without it, bit for bit, graph-replayed, and launches two prefetches a layer.
"""

import numpy as np
import pytest
from numba import cuda

import expert_service.cuda.l2_warm as l2_warm
from common.model_format import ModelDir
from expert_service.cuda.weights import DeviceWeights
from expert_service.kernels import expert_quant, l2_prefetch
from expert_service.kernels.numeric import SIMULATOR
from expert_service.tools.convert import convert
from tests.expert_service.cuda.test_weights import recorders
from tests.expert_service.tools.head_checkpoint import head_config, write_head_checkpoint

# (family, attention dtype, expert dtype)
MODELS = [("qwen3_moe", None, None), ("qwen2_moe", "int8", "int8"), ("mixtral", "fp8", "fp8")]


def device_weights(model: ModelDir, monkeypatch) -> DeviceWeights:
    """The model's weights through DeviceWeights (simulator: the upload is a copy, pinning recorded away)."""
    recorders(monkeypatch)
    return DeviceWeights(model, stream=cuda.default_stream())


def model_dir(tmp_path, family, attention, experts, seed=5) -> ModelDir:
    write_head_checkpoint(tmp_path / "hf", head_config(family), seed=seed)
    out = convert(tmp_path / "hf", tmp_path / "m", "bfloat16", False, expert_dtype=experts, attention_dtype=attention)
    return ModelDir.open(out)


def covered_bytes(dense: np.ndarray, table) -> bytes:
    return b"".join(dense[o : o + n].tobytes() for o, n in table.copy_to_host())


def tensor_bytes(model: ModelDir, names) -> bytes:
    return b"".join(model.raw_bytes(n).tobytes() for n in names)


@pytest.mark.parametrize("family,attention,experts", MODELS)
def test_tables_cover_the_weights_the_next_kernels_read(tmp_path, monkeypatch, family, attention, experts):
    model = model_dir(tmp_path, family, attention, experts)
    weights = device_weights(model, monkeypatch)
    cfg = model.config
    warm = l2_warm.L2Warmer(cfg, weights, cuda.default_stream())
    dense = weights.dense_buffer.copy_to_host()
    L = cfg.num_hidden_layers
    for i in range(L):
        got = covered_bytes(dense, warm.after_qkv[i])
        o = tensor_bytes(model, [f"layers.{i}.o_proj"])
        router = tensor_bytes(model, [f"layers.{i}.router"] if cfg.sparse_layers[i] else [])
        assert o in got and router in got, f"layer {i}: o projection and router"
        scales = 4 * cfg.hidden_size + 64 if attention else 0  # an 8-bit o block: codes, then their scales
        assert len(got) <= len(o) + len(router) + 2 * 16 + scales, f"layer {i}: little else"
        if i + 1 < L:
            qkv = [tensor_bytes(model, [f"layers.{i + 1}.{p}_proj"]) for p in ("q", "k", "v")]
            got = covered_bytes(dense, warm.after_router[i])
            assert all(part in got for part in qkv), f"layer {i + 1}: q|k|v"
            scales = 4 * (cfg.q_size + 2 * cfg.kv_size) + 64 if attention else 0
            assert len(got) <= sum(map(len, qkv)) + 3 * 2 * 16 + scales, f"layer {i + 1}: little else"
        else:
            assert covered_bytes(dense, warm.after_router[i]) == b""  # the table's empty row
    F, D = cfg.moe_intermediate_size, cfg.hidden_size
    for layer, span in warm.expert_bytes.items():
        if experts is None:  # gate, up and down back to back
            read = 3 * F * D * weights.dtype.itemsize
        else:  # codes, then the scales
            meta = weights.expert_meta_host[layer][0]
            read = expert_quant.block_offsets(int(meta[0]), int(meta[1]), F, D)[6]
        assert span == (0, read) and read <= weights.expert_strides[layer], "a tiny model's picks fit whole"
        assert cfg.num_experts_per_tok * read <= l2_warm.EXPERT_BYTES
    weights.close()


def test_experts_too_large_for_the_budget_warm_their_down_rows_or_nothing(tmp_path, monkeypatch):
    model = model_dir(tmp_path, "qwen2_moe", None, "int8")
    weights = device_weights(model, monkeypatch)
    cfg, layer = model.config, model.config.moe_layers[0]
    whole = l2_warm.L2Warmer(cfg, weights, cuda.default_stream()).expert_bytes[layer]
    meta = weights.expert_meta[layer].copy_to_host()[0]
    down = int(meta[4])  # the down rows' offset in the block: the warmed span starts there
    K = cfg.num_experts_per_tok
    monkeypatch.setattr(l2_warm, "EXPERT_BYTES", K * (whole[1] - down))
    assert l2_warm.L2Warmer(cfg, weights, cuda.default_stream()).expert_bytes[layer] == (down, whole[1])
    monkeypatch.setattr(l2_warm, "EXPERT_BYTES", K * (whole[1] - down) - 16)
    assert l2_warm.L2Warmer(cfg, weights, cuda.default_stream()).expert_bytes[layer] is None
    weights.close()


@pytest.mark.skipif(not SIMULATOR, reason="records the simulator's prefetch calls")
def test_the_kernel_prefetches_every_range_and_picked_block_once(monkeypatch):
    calls = []
    monkeypatch.setattr(l2_prefetch, "prefetch_l2_bulk", lambda a, i, n: calls.append((a.size, int(i), int(n))))
    monkeypatch.setattr(l2_prefetch, "PIECE", 64)  # several pieces a lane, and past the warp
    rng = np.random.default_rng(3)
    buffer = cuda.to_device(np.zeros(1 << 14, np.uint8))
    ranges = [[16, 48], [4096, 64 * 40 + 32], [9000 // 16 * 16, 1024]]
    table = cuda.to_device(np.concatenate([[[0, 0]], l2_prefetch.check_ranges(ranges, buffer.size)]))  # [0, 0]: none
    E, stride = 11, 320  # elements of bf16: 640-byte blocks
    experts = cuda.to_device(rng.integers(0, 1 << 16, (E, stride), dtype=np.uint16))
    picks = np.array([[3, 9, -1, 11, 0]], np.int32)  # -1 and 11 are outside [0, E): skipped
    l2_prefetch.launch_prefetch(buffer, table, experts=experts, ids=cuda.to_device(picks), lo=128, hi=640)

    def spans(size):
        pieces = sorted((i, n) for s, i, n in calls if s == size)
        assert all(0 < n <= 64 and n % 16 == 0 for _, n in pieces)
        merged = []
        for i, n in pieces:
            if merged and merged[-1][0] + merged[-1][1] == i:
                merged[-1][1] += n
            else:
                merged.append([i, n])
        assert len(set(pieces)) == len(pieces)  # nothing twice (an overlap would also break the spans below)
        return merged

    assert spans(buffer.size) == ranges
    assert spans(E * stride * 2) == [[e * 640 + 128, 512] for e in (0, 3, 9)]


def test_bad_prefetch_arguments_are_one_line():
    buffer = cuda.to_device(np.zeros(256, np.uint8))
    for ranges, what in (([[8, 32]], "offset 8"), ([[0, 24]], "size 24"), ([[0, 272]], "past the end"), ([], "none")):
        with pytest.raises(ValueError) as error:
            l2_prefetch.check_ranges(ranges, buffer.size)
        assert "\n" not in str(error.value), what
    experts = cuda.to_device(np.zeros((4, 64), np.uint8))
    ids = cuda.to_device(np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"^expert bytes \[0, 80\) of 64-byte blocks"):
        l2_prefetch.launch_prefetch(buffer, cuda.to_device(np.zeros((1, 2), np.int64)), experts=experts, ids=ids, hi=80)
    table = cuda.to_device(np.zeros((1, 2), np.int64))
    with pytest.raises(ValueError, match="^ids without experts"):
        l2_prefetch.launch_prefetch(buffer, table, ids=ids)
    with pytest.raises(ValueError, match="^experts without ids"):
        l2_prefetch.launch_prefetch(buffer, table, experts=experts, lo=0, hi=64)
    with pytest.raises(ValueError, match="^ids"):
        l2_prefetch.launch_prefetch(buffer, table, experts=experts, ids=cuda.to_device(np.zeros(2, np.int64)), hi=64)
    with pytest.raises(ValueError, match="^ranges"):
        l2_prefetch.launch_prefetch(buffer, cuda.to_device(np.zeros((1, 2), np.int32)))
    with pytest.raises(ValueError, match=r"^buffer starts at 0x[0-9a-f]+, not a multiple of 16 bytes"):
        l2_prefetch.launch_prefetch(buffer[8:], table)  # offsets checked from a start the prefetch cannot take
    with pytest.raises(ValueError, match=r"^experts starts at 0x[0-9a-f]+, not a multiple of 16 bytes"):
        l2_prefetch.launch_prefetch(buffer, table, experts=buffer[4:132].reshape(2, 64), ids=ids, hi=64)


def test_the_model_builds_its_warmer_only_once_the_option_is_on(monkeypatch):
    """Off (the default) the model builds no warmer: no tables uploaded, no layout checked at load; turned on, one
    warmer, built before the passes that use it and kept when the option goes off and on again."""
    from expert_service.cuda.model import CudaModel
    from expert_service.engine.cuda_options import CudaOptions

    made = []
    monkeypatch.setattr(l2_warm.L2Warmer, "make", lambda *a: made.append(a) or object())
    model = CudaModel.__new__(CudaModel)
    model.config, model.weights, model.stream = "config", "weights", "stream"
    model.moe, model.attention_8bit, model.head_8bit = type("Moe", (), {})(), None, None
    model.warm, model._warm_built = None, False
    model._build_warmer(CudaOptions())
    model.use_options(CudaOptions())
    assert model.warm is None and not made
    model.use_options(CudaOptions(l2_prefetch=True))
    warmer = model.warm
    assert made == [("config", "weights", "stream")] and warmer is not None and model._warm(True) is warmer
    model.use_options(CudaOptions())
    assert model._warm(True) is None
    model.use_options(CudaOptions(l2_prefetch=True))
    assert model.warm is warmer and len(made) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("family,attention,experts", MODELS)
def test_decode_with_prefetches_is_decode_without_them(tmp_path, monkeypatch, family, attention, experts):
    """Greedy decode of one sequence and of three, graph-replayed: the same tokens and logits bit for bit; the
    eager steps launch two prefetches a MoE layer at one token (one after q|k|v, one after the router)."""
    from expert_service.backends import build_engine
    from expert_service.engine.config import EngineConfig
    from expert_service.engine.cuda_options import CudaOptions
    from expert_service.engine.engine import PrefillInput
    from expert_service.engine.sampling import SamplingParams
    from tests.helpers import random_prompt

    model = model_dir(tmp_path, family, attention, experts)
    cfg = dict(kv_block_size=8, kv_cache_tokens=2048, max_batch_tokens=256, max_batch_size=4, backend="cuda")

    def run(options, graphs=True):
        engine = build_engine(model, EngineConfig(**cfg, cuda_options=options, cuda_graphs=graphs))
        out = []
        for rids in ([0], [1, 2, 3]):
            engine.step(
                [PrefillInput(r, np.array(random_prompt(60 + r, 5 + 7 * r)), SamplingParams(), True) for r in rids]
            )
            for _ in range(6):
                result = engine.step(decode_ids=rids)
                out.append(([o.token_id for o in result.outputs], np.stack(list(result.logits))))
            engine.clear()
        engine.decoder.close()
        return out

    made = []
    real_make = l2_warm.L2Warmer.make
    monkeypatch.setattr(l2_warm.L2Warmer, "make", lambda *a: made.append(1) or real_make(*a))
    plain = run(CudaOptions())
    assert not made  # off: no warmer built, nothing uploaded or checked
    warmed = run(CudaOptions(l2_prefetch=True))
    assert made == [1]
    for step, ((ta, la), (tb, lb)) in enumerate(zip(plain, warmed)):
        assert ta == tb and np.array_equal(la, lb), f"step {step}"
    launches = []
    monkeypatch.setattr(l2_warm, "launch_prefetch", lambda *a, **k: launches.append(k.get("experts") is not None))
    eager = run(CudaOptions(l2_prefetch=True), graphs=False)
    assert [t for t, _ in eager] == [t for t, _ in plain]
    L, moe = model.config.num_hidden_layers, model.config.moe_layers
    assert launches.count(True) == 6 * len(moe)  # the one-sequence decode steps' picked experts
    # every layer's o / router after q|k|v; after each router the next layer's q|k|v (the last layer's: only picks)
    assert len(launches) == 12 * L + sum(6 + (6 if i + 1 < L else 0) for i in moe)
