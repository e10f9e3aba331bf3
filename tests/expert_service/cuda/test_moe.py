"""cuda/moe.py's DeviceMoe wiring in Numba's CUDA simulator (no GPU): routing=lut's planned ids read from the
staged plan (workspace.stage_routed_ids's layout) and the combine fused with the next layer's input RMSNorm,
on the strategies that need no cuBLAS (GEMV at one token, GROUPED below T*K = E), against numpy's
`sparse_moe(..., planned_ids)` + `rms_norm`, and bit for bit against the unfused combine + rmsnorm."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from common.models import config_from_hf
from expert_service.cpu.layers.moe import sparse_moe, swiglu_mlp
from expert_service.cpu.layers.norm import rms_norm
from expert_service.cuda.linear import DeviceLinear
from expert_service.cuda.moe import DeviceMoe, cublas_rows
from expert_service.cuda.moe_strategy import MoeStrategy, choose_strategy
from expert_service.cuda.workspace import Workspace, layout_workspace, stage_routed_ids
from expert_service.engine.cuda_options import CudaOptions
from expert_service.kernels.rmsnorm import launch_rmsnorm
from expert_service.tools.tiny_model import tiny_hf_config
from tests.helpers import expert_buffer, random_ids

MAX_TOKENS = 4


class Weights:
    """The parts of DeviceWeights the MoE block reads: layer tensors, each MoE layer's expert array, dtype."""

    def __init__(self, config, rng):
        D, E, F, Fs = (
            config.hidden_size,
            config.num_experts,
            config.moe_intermediate_size,
            config.shared_expert_intermediate_size,
        )
        self.dtype, self.quantized, self.all_8bit = np.dtype(np.float32), False, False
        self.host, self.mats, self.experts = {}, {}, {}
        for i in config.moe_layers:
            shapes = {"router": (E, D)}
            if Fs:
                shapes.update(
                    shared_gate_proj=(Fs, D),
                    shared_up_proj=(Fs, D),
                    shared_down_proj=(D, Fs),
                    shared_expert_gate=(1, D),
                )
            for name, shape in shapes.items():
                self.host[i, name] = rng.standard_normal(shape).astype(np.float32) * np.float32(shape[1] ** -0.5)
            buffer, self.mats[i] = expert_buffer(rng, E, F, D, np.float32)
            self.experts[i] = cuda.to_device(buffer)
        self.device = {key: cuda.to_device(a) for key, a in self.host.items()}

    def layer(self, i, name):
        return self.device[i, name]


def reference(weights, config, layer, x, planned):
    """The cpu decoder's MoE block (cpu/decoder.py _mlp) with LUT routing: routed experts + the shared expert."""
    w = lambda name: weights.host[layer, name]  # noqa: E731
    out, ids = sparse_moe(
        x,
        w("router"),
        config.num_experts_per_tok,
        config.norm_topk_prob,
        lambda e: weights.mats[layer][e],
        planned_ids=planned.astype(np.int64),
    )
    np.testing.assert_array_equal(ids, planned)
    if config.shared_expert_intermediate_size:
        shared = swiglu_mlp(x, w("shared_gate_proj"), w("shared_up_proj"), w("shared_down_proj"))
        out = out + shared / (np.float32(1.0) + np.exp(-(x @ w("shared_expert_gate").T)))
    return out


def setup(family: str):
    overrides = {
        "mixtral": {"num_local_experts": 8, "intermediate_size": 8},
        "qwen2_moe": {"num_experts": 8, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 12},
    }
    config = config_from_hf({**tiny_hf_config(family), "hidden_size": 16, **overrides[family]})
    rng = np.random.default_rng(11)
    layout = layout_workspace(config, np.dtype(np.float32), MAX_TOKENS, 2, 4, len(config.moe_layers), planned=True)
    ws = Workspace(
        {name: cuda.device_array(shape, dtype) for name, (shape, dtype) in layout.items() if name != "cublas_workspace"}
    )
    weights = Weights(config, rng)
    moe = DeviceMoe(config, weights, ws, DeviceLinear(0, None, ws, np.float32), 0, None, CudaOptions(), planned=True)
    return config, rng, ws, weights, moe


# one token: GEMV (the shared expert's linears too); 3 tokens: GROUPED (T*K < E); qwen2_moe: a shared expert
@pytest.mark.parametrize(
    "family,T,strategy",
    [("mixtral", 1, MoeStrategy.GEMV), ("mixtral", 3, MoeStrategy.GROUPED), ("qwen2_moe", 1, MoeStrategy.GEMV)],
)
@pytest.mark.parametrize("fuse_from", [1, None])  # 1: fuse at these sizes; None: the default (large steps only)
def test_planned_routing_and_fused_norm(family, T, strategy, fuse_from, monkeypatch):
    import expert_service.cuda.moe as moe_module

    if fuse_from:
        monkeypatch.setattr(moe_module, "FUSED_COMBINE_NORM_MIN_TOKENS", fuse_from)
    threshold = moe_module.FUSED_COMBINE_NORM_MIN_TOKENS
    assert T < threshold or fuse_from
    config, rng, ws, weights, moe = setup(family)
    K, E, D, layer = config.num_experts_per_tok, config.num_experts, config.hidden_size, config.moe_layers[-1]
    assert choose_strategy(T, K, E, cached=False) is strategy
    plans = {i: random_ids(rng, T, K, E) for i in config.moe_layers}
    host = np.empty(ws.routed_ids.shape, np.int32)
    n = stage_routed_ids(host, plans, config.moe_layers, T, T, K)
    ws.routed_ids[:n].copy_to_device(host[:n])
    x = rng.standard_normal((T, D)).astype(np.float32)
    h = rng.standard_normal((T, D)).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    d_norm = cuda.to_device(norm)
    index = config.moe_layers.index(layer)
    runs = []
    for next_norm in (d_norm, None):
        ws.normed[:T].copy_to_device(x)
        ws.hidden[:T].copy_to_device(h)
        wrote = moe.forward(layer, ws.normed[:T], ws.hidden[:T], T, next_norm=next_norm)
        # a shared expert reads x after the combine, and a small step's combine runs spread over blocks: then
        # the block leaves the norm to the decoder
        assert wrote is (next_norm is not None and not config.shared_expert_intermediate_size and T >= threshold)
        if not wrote:
            launch_rmsnorm(ws.hidden[:T], d_norm, config.rms_norm_eps, ws.normed[:T])
        ids = ws.topk_ids.reshape(-1)[index * T * K : (index + 1) * T * K].copy_to_host().reshape(T, K)
        runs.append((ws.hidden[:T].copy_to_host(), ws.normed[:T].copy_to_host(), ids))
    (h_fused, x_fused, ids), (h_plain, x_plain, _) = runs
    np.testing.assert_array_equal(ids, plans[layer])  # the trace holds the plan's experts
    want_h = h + reference(weights, config, layer, x, plans[layer])
    np.testing.assert_allclose(h_fused, want_h, rtol=1e-5, atol=1e-5 * np.abs(want_h).max())
    np.testing.assert_allclose(x_fused, rms_norm(want_h, norm, config.rms_norm_eps), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(h_fused, h_plain)  # fused == combine, then rmsnorm: same bits
    np.testing.assert_array_equal(x_fused, x_plain)


def test_cublas_rows_round_up_and_stay_in_the_buffer():
    rows = np.array([1, 63, 64, 65, 1024, 1025, 5000])
    assert cublas_rows(rows, np.full(7, 10**6)).tolist() == [64, 64, 64, 128, 1024, 1280, 5120]
    assert cublas_rows(np.array([5, 100]), np.array([40, 90])).tolist() == [40, 90]


@pytest.mark.parametrize("seed", range(5))
def test_rounded_expert_windows_leave_every_row_to_its_own_expert(seed):
    """Per-expert GEMMs issued in expert order over rounded windows [lo, lo + rounded): each of the step's rows is
    written last by its own expert's GEMM, and nothing is written past the buffer."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 300, 8) * (rng.random(8) < 0.8)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    cap = int(offsets[-1]) + int(rng.integers(0, 50))
    active = np.flatnonzero(np.diff(offsets))
    lo = offsets[active]
    windows = cublas_rows(np.diff(offsets)[active], cap - lo)
    owner = np.full(cap, -1)
    for e, start, m in zip(active, lo, windows):
        assert start + m <= cap
        owner[start : start + m] = e
    n = int(offsets[-1])
    assert (owner[:n] == np.repeat(np.arange(8), counts)).all()


class FakeDeviceArray:
    """Shape, dtype and a made-up device address: what _expert_gemms reads of workspace buffers (no GPU)."""

    def __init__(self, shape, dtype, address):
        self.shape, self.dtype, self.address = shape, np.dtype(dtype), address
        self.__cuda_array_interface__ = {"data": (address, False)}

    def __getitem__(self, rows):
        return FakeDeviceArray((len(range(*rows.indices(self.shape[0]))),) + self.shape[1:], self.dtype, self.address)


@pytest.mark.parametrize(
    "weights_dtype,gate_up_dtype", [(np.uint16, np.uint16), (np.float16, np.float32), (np.float32, np.float32)]
)
def test_expert_gemms_issue_one_gate_up_and_one_down_gemm_per_active_expert(monkeypatch, weights_dtype, gate_up_dtype):
    """The host step of per-expert cuBLAS, with a recording cuBLAS: after the stream sync, per active expert (in
    expert order) gate|up [rows, 2F] from its block's start into the layout's gate|up dtype (bf16 for bf16
    weights, f32 otherwise), SwiGLU over the step's n rows, then down [rows, D] f32 from the block's down matrix;
    rows rounded up (cublas_rows) within the smallest buffer; empty experts skipped."""
    from types import SimpleNamespace

    import expert_service.cuda.moe as moe_module

    config = config_from_hf(
        {**tiny_hf_config("mixtral"), "hidden_size": 16, "num_local_experts": 4, "intermediate_size": 8}
    )
    D, F, E = config.hidden_size, config.moe_intermediate_size, config.num_experts
    layout = layout_workspace(config, np.dtype(weights_dtype), 128, 2, 4, len(config.moe_layers))
    assert layout["expert_gate_up"][1] == np.dtype(gate_up_dtype)
    address = iter(range(1 << 20, 1 << 40, 1 << 30))
    ws = SimpleNamespace(
        **{
            name: FakeDeviceArray(shape, dtype, next(address))
            for name, (shape, dtype) in layout.items()
            if name.startswith("expert_") or name == "moe_out"
        }
    )
    counts = np.array([70, 0, 3, 183])  # n = 256 assignments (T = 128, K = 2); expert 1 empty
    ws.host = {"offsets": np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)}
    calls = []
    blas = SimpleNamespace(
        linear_each=lambda w, x, y, rows, n, k, dtype, out_dtype=np.float32: calls.append(
            ("gemm", w.tolist(), x.tolist(), y.tolist(), rows.tolist(), n, k, np.dtype(dtype), np.dtype(out_dtype))
        )
    )

    class RecordingSwiglu:  # SiluMulHalves made once on the whole buffers, called on the step's rows
        def __init__(self, gu, h):
            self.buffers = (gu.shape, h.shape, gu.dtype, h.dtype)
            made.append(self)

        def __call__(self, r0, r1, stream):
            rows = r1 - r0
            calls.append(("swiglu", (rows, self.buffers[0][1]), (rows, self.buffers[1][1])) + self.buffers[2:])

    made: list = []
    monkeypatch.setattr(moe_module.elementwise, "SiluMulHalves", RecordingSwiglu)
    experts = FakeDeviceArray((E, 3 * F * D + 8), weights_dtype, 7 << 40)
    moe = SimpleNamespace(
        config=config,
        ws=ws,
        linear=SimpleNamespace(cublas=blas),
        weights=SimpleNamespace(dtype=np.dtype(weights_dtype)),
        stream=SimpleNamespace(synchronize=lambda: calls.append(("sync",))),
        quantized=False,
    )
    moe._gemm_group = lambda *args: DeviceMoe._gemm_group(moe, *args)
    moe._swiglu = None
    moe._swiglu_rows = lambda *args: DeviceMoe._swiglu_rows(moe, *args)
    DeviceMoe._expert_gemms(moe, 256, experts)
    item, gu_item = np.dtype(weights_dtype).itemsize, np.dtype(gate_up_dtype).itemsize
    block = experts.shape[1] * item
    lo, active = [0, 70, 73], [0, 2, 3]
    room = min(b.shape[0] for b in (ws.expert_x, ws.expert_gate_up, ws.expert_h, ws.moe_out))
    rows = cublas_rows(np.array([70, 3, 183]), room - np.array(lo)).tolist()
    starts = [experts.address + e * block for e in active]
    assert calls[0] == ("sync",)
    assert calls[1] == (
        "gemm",
        starts,
        [ws.expert_x.address + r * D * item for r in lo],
        [ws.expert_gate_up.address + r * 2 * F * gu_item for r in lo],
        rows,
        2 * F,
        D,
        np.dtype(weights_dtype),
        np.dtype(gate_up_dtype),
    )
    assert calls[2] == ("swiglu", (256, 2 * F), (256, F), np.dtype(gate_up_dtype), np.dtype(weights_dtype))
    assert calls[3] == (
        "gemm",
        [s + 2 * F * D * item for s in starts],
        [ws.expert_h.address + r * F * item for r in lo],
        [ws.moe_out.address + r * D * 4 for r in lo],
        rows,
        D,
        F,
        np.dtype(weights_dtype),
        np.dtype(np.float32),
    )
    assert len(calls) == 4 and rows[-1] >= 183 and 73 + rows[-1] <= room
    assert len(made) == 1 and made[0].buffers[:2] == (ws.expert_gate_up.shape, ws.expert_h.shape)
    DeviceMoe._expert_gemms(moe, 256, experts)  # a second step reuses the launcher's views
    assert len(made) == 1 and calls[4:] == calls[:4]


def test_swiglu_rows_of_a_later_group_reuse_the_launcher(monkeypatch):
    """A later 8-bit group's rows [r0, r1) (r0 > 0) go to the same launcher, made once, on exactly those rows."""
    from types import SimpleNamespace

    import expert_service.cuda.moe as moe_module

    made, calls = [], []

    class RecordingSwiglu:
        def __init__(self, gu, h):
            made.append((gu.shape, h.shape))

        def __call__(self, r0, r1, stream):
            calls.append((r0, r1))

    monkeypatch.setattr(moe_module.elementwise, "SiluMulHalves", RecordingSwiglu)
    ws = SimpleNamespace(
        expert_gate_up=FakeDeviceArray((64, 16), np.uint16, 1 << 30),
        expert_h=FakeDeviceArray((64, 8), np.uint16, 1 << 31),
    )
    moe = SimpleNamespace(ws=ws, stream=None, _swiglu=None)
    for r0, r1 in ((0, 24), (24, 40), (40, 41)):
        DeviceMoe._swiglu_rows(moe, r0, r1)
    assert made == [((64, 16), (64, 8))] and calls == [(0, 24), (24, 40), (40, 41)]


def test_eight_bit_groups_widen_through_one_launcher_per_layer_and_half(monkeypatch):
    """8-bit layers' host step: each group of active experts is widened into its scratch half by a DequantInto
    made once per (layer's experts, half) and reused by later steps, then its GEMMs and SwiGLU run on the group's
    rows; groups alternate halves as DequantPipeline hands them out."""
    from types import SimpleNamespace

    import expert_service.cuda.moe as moe_module

    config = config_from_hf(
        {**tiny_hf_config("mixtral"), "hidden_size": 16, "num_local_experts": 4, "intermediate_size": 8}
    )
    D, F = config.hidden_size, config.moe_intermediate_size
    layout = layout_workspace(config, np.dtype(np.uint16), 128, 2, 4, len(config.moe_layers))
    address = iter(range(1 << 20, 1 << 40, 1 << 30))
    ws = SimpleNamespace(
        **{
            name: FakeDeviceArray(shape, dtype, next(address))
            for name, (shape, dtype) in layout.items()
            if name.startswith("expert_") or name == "moe_out"
        }
    )
    group = 1  # one expert a half: three active experts take three groups
    ws.dequant = FakeDeviceArray((2 * group, 3 * F * D), np.uint16, next(address))
    ws.offsets = "device offsets"
    ws.host = {"offsets": np.concatenate([[0], np.cumsum([70, 0, 3, 183])]).astype(np.int32)}
    made, widened, calls = [], [], []

    class RecordingDequant:
        def __init__(self, experts, meta, offsets, f, d, out):
            made.append((experts.address, out.address, out.shape[0]))

        def __call__(self, first, g, stream):
            widened.append((first, g))

    monkeypatch.setattr(moe_module, "DequantInto", RecordingDequant)
    pipeline = SimpleNamespace(
        run=lambda count, widen, gemms: [(widen(i, i % 2, None), gemms(i, i % 2)) for i in range(count)]
    )
    moe = SimpleNamespace(
        config=config,
        ws=ws,
        weights=SimpleNamespace(dtype=np.dtype(np.uint16)),
        stream=SimpleNamespace(synchronize=lambda: None),
        options=SimpleNamespace(overlap_dequant=True),
        dequant_pipeline=pipeline,
        _dequant_into={},
        _gemm_group=lambda gate, lo, rows, r0, r1: calls.append((r0, r1)),
    )
    experts = [FakeDeviceArray((4, 64), np.uint8, a) for a in (7 << 40, 9 << 40)]  # two layers' 8-bit blocks
    for layer in (0, 1, 0):
        DeviceMoe._expert_gemms(moe, 256, experts[layer], meta="layer meta")
    halves = [ws.dequant.address, ws.dequant.address]  # FakeDeviceArray slices keep the start address
    assert made == [(experts[0].address, halves[0], 1), (experts[0].address, halves[1], 1)] + [
        (experts[1].address, halves[0], 1),
        (experts[1].address, halves[1], 1),
    ]
    assert widened == [(0, 1), (1, 1), (2, 1)] * 3
    assert calls == [(0, 70), (70, 73), (73, 256)] * 3


@pytest.mark.parametrize("T,strategy", [(1, MoeStrategy.GEMV), (3, MoeStrategy.GROUPED)])
def test_an_l2_warmer_gets_the_routers_ids_and_whether_they_are_streamed_by_slot(T, strategy):
    """After the router the warmer is handed the ids the step's experts then read (resident: a one-token step
    streaming them by slot), and the outputs are the same as without it."""
    config, rng, ws, weights, moe = setup("mixtral")
    K, E, D, layer = config.num_experts_per_tok, config.num_experts, config.hidden_size, config.moe_layers[0]
    assert choose_strategy(T, K, E, cached=False) is strategy
    calls = []

    class Warm:
        def experts(self, i, ids, resident):
            calls.append((i, ids.copy_to_host(), resident))

    plans = {i: random_ids(rng, T, K, E) for i in config.moe_layers}  # setup's engine routes by plan
    host = np.empty(ws.routed_ids.shape, np.int32)
    n = stage_routed_ids(host, plans, config.moe_layers, T, T, K)
    ws.routed_ids[:n].copy_to_device(host[:n])
    x = rng.standard_normal((T, D)).astype(np.float32)
    h = rng.standard_normal((T, D)).astype(np.float32)
    outs = []
    for warm in (Warm(), None):
        ws.normed[:T].copy_to_device(x)
        ws.hidden[:T].copy_to_device(h)
        moe.forward(layer, ws.normed[:T], ws.hidden[:T], T, warm=warm)
        outs.append(ws.hidden[:T].copy_to_host())
    ((i, ids, resident),) = calls
    index = config.moe_layers.index(layer)
    trace = ws.topk_ids.reshape(-1)[index * T * K : (index + 1) * T * K].copy_to_host().reshape(T, K)
    assert i == layer and resident is (T == 1) and np.array_equal(ids, trace) and np.array_equal(ids, plans[layer])
    np.testing.assert_array_equal(outs[0], outs[1])
