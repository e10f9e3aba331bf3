"""moe_q8 (8-bit and mixed-dtype experts, dequantised in registers) vs expert_quant's numpy reference: by slot
(one token) and grouped, every dtype code and scale scheme in one layer, the kernel compiled for the layer's
(code, scheme) pairs (simulator on tiny shapes)."""

import numpy as np
import pytest
from numba import cuda

from expert_service.experts.grouping import group_by_expert
from expert_service.kernels import expert_quant as q
from expert_service.kernels import moe_q8
from expert_service.kernels.expert_quant import layer_kinds
from expert_service.kernels.moe_q8 import ALL_KINDS, UNROLL, LaunchShape, launch_q8_down, launch_q8_gate_up

# every (dtype, scheme) an expert can have: 8-bit with either scale, and the unquantized 16-bit dtypes
KINDS = [
    (q.CODE_INT8, q.SCALE_CHANNEL),
    (q.CODE_FP8, q.SCALE_BLOCK),
    (q.CODE_BF16, q.SCALE_NONE),
    (q.CODE_FP8, q.SCALE_CHANNEL),
    (q.CODE_F16, q.SCALE_NONE),
    (q.CODE_F32, q.SCALE_NONE),
]


def mixed_layer(rng, kinds, F, D):
    """uint8 [E, stride] blocks of random experts in `kinds` (the stride of the largest, 4096-aligned), meta
    [E, 8], and each expert's dequantised (gate, up, down)."""
    sizes = [q.block_offsets(c, s, F, D)[6] for c, s in kinds]
    stride = -(-max(sizes) // 4096) * 4096
    blocks, metas, mats = [], [], []
    for code, scheme in kinds:
        gate, up = (rng.standard_normal((F, D)).astype(np.float32) * 0.2 for _ in range(2))
        down = rng.standard_normal((D, F)).astype(np.float32) * 0.2
        block, meta = q.pack_block(gate, up, down, code, scheme, stride)
        blocks.append(block)
        metas.append(meta)
        mats.append(q.dequantize(block, meta, F, D))
    return np.stack(blocks), np.stack(metas), mats


def reference(x_rows, mats, F):
    gate, up, down = (m.astype(np.float64) for m in mats)
    xd = x_rows.astype(np.float64)
    g = xd @ gate.T
    return g / (1.0 + np.exp(-g)) * (xd @ up.T), down


def check_close(got, ref):
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("F,D", [(144, 48)])  # 144: two 128-row scale blocks, a partial one
def test_by_slot_matches_reference(F, D):
    rng = np.random.default_rng(F + D)
    W, meta, mats = mixed_layer(rng, KINDS, F, D)
    ids = np.array([[3, 1, 4, 3, 0, 5, 2]], np.int32)  # every kind, one expert twice
    K = ids.shape[1]
    x = rng.standard_normal((1, D)).astype(np.float32)
    dW, dmeta, dids = cuda.to_device(W), cuda.to_device(meta), cuda.to_device(ids)
    h = cuda.to_device(np.full((K, F), np.nan, np.float32))
    y = cuda.to_device(np.full((K, D), np.nan, np.float32))
    launch_q8_gate_up(cuda.to_device(x), dW, dmeta, F, D, h, ids=dids, kinds=layer_kinds(meta))
    launch_q8_down(h, dW, dmeta, F, D, y, ids=dids, kinds=layer_kinds(meta))
    h, y = h.copy_to_host(), y.copy_to_host()
    assert np.isfinite(h).all() and np.isfinite(y).all()  # every element written
    for k, e in enumerate(ids[0]):
        ref_h, down = reference(x, mats[e], F)
        check_close(h[k : k + 1], ref_h)
        check_close(y[k], h[k].astype(np.float64) @ down.T)


def test_grouped_matches_reference():
    F, D, T, K = 48, 64, 5, 3
    rng = np.random.default_rng(7)
    kinds = KINDS + [(q.CODE_INT8, q.SCALE_CHANNEL)]  # expert 6 gets no tokens below
    W, meta, mats = mixed_layer(rng, kinds, F, D)
    E = len(kinds)
    ids = np.array([[0, 1, 2], [3, 4, 5], [0, 3, 1], [2, 0, 4], [5, 0, 3]], np.int32)
    x = rng.standard_normal((T, D)).astype(np.float32)
    groups = group_by_expert(ids, E)
    order, offsets = groups.order.astype(np.int32), groups.offsets.astype(np.int32)
    h = cuda.to_device(np.full((T * K, F), np.nan, np.float32))
    y = cuda.to_device(np.full((T * K, D), np.nan, np.float32))
    dW, dmeta, doffsets = cuda.to_device(W), cuda.to_device(meta), cuda.to_device(offsets)
    kinds = layer_kinds(meta)
    launch_q8_gate_up(cuda.to_device(x), dW, dmeta, F, D, h, order=cuda.to_device(order), offsets=doffsets, kinds=kinds)
    launch_q8_down(h, dW, dmeta, F, D, y, offsets=doffsets, kinds=kinds)
    h, y = h.copy_to_host(), y.copy_to_host()
    assert np.isfinite(h).all() and np.isfinite(y).all()
    for e in range(E):
        lo, hi = offsets[e], offsets[e + 1]
        if lo == hi:
            continue
        ref_h, down = reference(x[order[lo:hi] // K], mats[e], F)
        check_close(h[lo:hi], ref_h)
        check_close(y[lo:hi], h[lo:hi].astype(np.float64) @ down.T)


def test_slots_in_waves_match_reference():
    """The expert cache's launches: the layer's experts in a slot buffer of S < E blocks, each wave's slot_of
    naming the experts it computes (-1: another wave's). Rows of skipped experts stay untouched; after both
    waves every row is written and equals the reference; meta stays indexed by expert id."""
    F, D, T, K = 48, 64, 5, 3
    rng = np.random.default_rng(11)
    W, meta, mats = mixed_layer(rng, KINDS, F, D)
    E, S = len(KINDS), 4
    ids = np.array([[0, 1, 2], [3, 4, 5], [0, 3, 1], [2, 0, 4], [5, 0, 3]], np.int32)
    x = rng.standard_normal((T, D)).astype(np.float32)
    groups = group_by_expert(ids, E)
    order, offsets = groups.order.astype(np.int32), groups.offsets.astype(np.int32)
    waves = [{5: 2, 1: 0, 3: 3}, {0: 1, 2: 3, 4: 0}]  # expert -> slot; slots reused by the second wave
    h = cuda.to_device(np.full((T * K, F), np.nan, np.float32))
    y = cuda.to_device(np.full((T * K, D), np.nan, np.float32))
    dmeta, dx, dorder, doffsets = (cuda.to_device(a) for a in (meta, x, order, offsets))
    computed: set[int] = set()
    for wave in waves:
        slots = rng.integers(0, 256, (S, W.shape[1]), dtype=np.uint8)  # stale bytes in every slot
        slot_of = np.full(E, -1, np.int32)
        for e, s in wave.items():
            slots[s], slot_of[e] = W[e], s
        dslots, dslot_of = cuda.to_device(slots), cuda.to_device(slot_of)
        q8 = dict(offsets=doffsets, slot_of=dslot_of, kinds=layer_kinds(meta))
        launch_q8_gate_up(dx, dslots, dmeta, F, D, h, order=dorder, **q8)
        launch_q8_down(h, dslots, dmeta, F, D, y, **q8)
        computed |= set(wave)
        hh, yy = h.copy_to_host(), y.copy_to_host()
        for e in range(E):
            lo, hi = offsets[e], offsets[e + 1]
            if e not in computed:
                assert np.isnan(hh[lo:hi]).all() and np.isnan(yy[lo:hi]).all(), f"expert {e} written early"
                continue
            ref_h, down = reference(x[order[lo:hi] // K], mats[e], F)
            check_close(hh[lo:hi], ref_h)
            check_close(yy[lo:hi], hh[lo:hi].astype(np.float64) @ down.T)
    assert np.isfinite(hh).all() and np.isfinite(yy).all()


def test_by_slot_through_slots_matches_reference():
    F, D = 32, 48
    rng = np.random.default_rng(5)
    W, meta, mats = mixed_layer(rng, KINDS[:4], F, D)
    ids = np.array([[2, 0]], np.int32)
    slots = rng.integers(0, 256, (3, W.shape[1]), dtype=np.uint8)
    slots[1], slots[2] = W[0], W[2]
    slot_of = np.array([1, -1, 2, -1], np.int32)
    x = rng.standard_normal((1, D)).astype(np.float32)
    h = cuda.to_device(np.full((2, F), np.nan, np.float32))
    y = cuda.to_device(np.full((2, D), np.nan, np.float32))
    dslots, dmeta, dids, dslot_of = (cuda.to_device(a) for a in (slots, meta, ids, slot_of))
    q8 = dict(ids=dids, slot_of=dslot_of, kinds=layer_kinds(meta))
    launch_q8_gate_up(cuda.to_device(x), dslots, dmeta, F, D, h, **q8)
    launch_q8_down(h, dslots, dmeta, F, D, y, **q8)
    h, y = h.copy_to_host(), y.copy_to_host()
    assert np.isfinite(h).all() and np.isfinite(y).all()
    for k, e in enumerate(ids[0]):
        ref_h, down = reference(x, mats[e], F)
        check_close(h[k : k + 1], ref_h)
        check_close(y[k], h[k].astype(np.float64) @ down.T)


def test_long_rows_stream_whole_steps_and_a_tail():
    """Rows long enough for the unrolled main loop plus a partial last step: n = one step of chunks (32 lanes x
    UNROLL, 16 values each) plus one chunk (simulator 528, GPU 1040, over several 128-wide scale blocks), gate/up
    (D = n) and down (F = n) on layers with few output rows (the simulator's cost is in the rows), by slot, int8
    and block-scaled e4m3 in one layer."""
    rng = np.random.default_rng(3)
    kinds = [(q.CODE_INT8, q.SCALE_CHANNEL), (q.CODE_FP8, q.SCALE_BLOCK)]
    ids = np.array([[1, 0]], np.int32)
    n = 16 * (32 * UNROLL + 1)
    for F, D in ((16, n), (n, 16)):
        W, meta, mats = mixed_layer(rng, kinds, F, D)
        q8 = dict(ids=cuda.to_device(ids), kinds=layer_kinds(meta))
        dW, dmeta = cuda.to_device(W), cuda.to_device(meta)
        if F == 16:
            x = rng.standard_normal((1, D)).astype(np.float32)
            h = cuda.to_device(np.full((2, F), np.nan, np.float32))
            launch_q8_gate_up(cuda.to_device(x), dW, dmeta, F, D, h, **q8)
            got, refs = h.copy_to_host(), [reference(x, mats[e], F)[0][0] for e in ids[0]]
        else:
            hx = rng.standard_normal((2, F)).astype(np.float32)
            y = cuda.to_device(np.full((2, D), np.nan, np.float32))
            launch_q8_down(cuda.to_device(hx), dW, dmeta, F, D, y, **q8)
            got = y.copy_to_host()
            refs = [hx[k].astype(np.float64) @ mats[e][2].astype(np.float64).T for k, e in enumerate(ids[0])]
        assert np.isfinite(got).all()
        for k in range(2):
            check_close(got[k], refs[k])


@pytest.mark.parametrize(
    "shape", [LaunchShape(2, 1, 2, 1, 4), LaunchShape(1, 3, 1, 2, 3), moe_q8.DECODE_SHAPE._replace(late_scales=1)]
)
def test_launch_shapes_give_the_default_bits(shape, monkeypatch):
    """Another launch shape (warps a block, rows a warp, chunks in flight, channel scales read before the stream
    or after the sums) changes which warp computes a row or when a scale arrives, not a lane's chunks or their
    order: the same bits as the default shape, every row written (rows not a multiple
    of a warp's rows included), int8 and block-scaled e4m3 in one layer, by slot."""
    rng = np.random.default_rng(12)
    F, D = 80, 48 * 3
    W, meta, _ = mixed_layer(rng, [(q.CODE_INT8, q.SCALE_CHANNEL), (q.CODE_FP8, q.SCALE_BLOCK)], F, D)
    dW, dmeta = cuda.to_device(W), cuda.to_device(meta)
    q8 = dict(ids=cuda.to_device(np.array([[1, 0]], np.int32)), kinds=layer_kinds(meta))
    x = cuda.to_device(rng.standard_normal((1, D)).astype(np.float32))
    built = []
    kernel = moe_q8._kernel
    monkeypatch.setattr(moe_q8, "_kernel", lambda *key: (built.append(key[1:4]), kernel(*key))[1])
    outs = []
    for launch_shape in (None, shape):
        extra = {} if launch_shape is None else {"shape": launch_shape}
        h = cuda.to_device(np.full((2, F), np.nan, np.float32))
        y = cuda.to_device(np.full((2, D), np.nan, np.float32))
        launch_q8_gate_up(x, dW, dmeta, F, D, h, **q8, **extra)
        launch_q8_down(h, dW, dmeta, F, D, y, **q8, **extra)
        outs.append((h.copy_to_host(), y.copy_to_host()))
    assert np.isfinite(outs[1][0]).all() and np.isfinite(outs[1][1]).all()
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])
    # the second pair of launches took kernels built for `shape` (the default's would pass the comparison trivially)
    assert built[-2:] == [(True, 1, shape), (False, 1, shape)]


def test_experts_of_unlisted_kinds_are_not_computed():
    """kinds names the paths compiled in: an expert of another (code, scheme) leaves its rows untouched (a caller
    passing the wrong kinds sees NaN, never another encoding's arithmetic)."""
    F, D = 32, 32
    rng = np.random.default_rng(9)
    W, meta, mats = mixed_layer(rng, [(q.CODE_INT8, q.SCALE_CHANNEL), (q.CODE_FP8, q.SCALE_CHANNEL)], F, D)
    ids = cuda.to_device(np.array([[0, 1]], np.int32))
    x = rng.standard_normal((1, D)).astype(np.float32)
    h = cuda.to_device(np.full((2, F), np.nan, np.float32))
    launch_q8_gate_up(
        cuda.to_device(x),
        cuda.to_device(W),
        cuda.to_device(meta),
        F,
        D,
        h,
        ids=ids,
        kinds=[(q.CODE_INT8, q.SCALE_CHANNEL)],
    )
    h = h.copy_to_host()
    check_close(h[:1], reference(x, mats[0], F)[0])
    assert np.isnan(h[1]).all()


def test_reference_dequantises_what_was_quantised():
    """The packer/decoder pair the kernels are checked against: q * scale within one quantisation step."""
    rng = np.random.default_rng(1)
    F, D = 144, 160
    for code, scheme in KINDS:
        gate, up, down = (rng.standard_normal(s).astype(np.float32) for s in ((F, D), (F, D), (D, F)))
        block, meta = q.pack_block(gate, up, down, code, scheme)
        for want, got in zip((gate, up, down), q.dequantize(block, meta, F, D)):
            step = {q.CODE_INT8: 1 / 127, q.CODE_FP8: 1 / 8, q.CODE_BF16: 1 / 128, q.CODE_F16: 1 / 1024, q.CODE_F32: 0}[
                code
            ]
            assert np.abs(got - want).max() <= step * np.abs(want).max(), (code, scheme)


def test_bad_shapes_are_refused():
    W = cuda.to_device(np.zeros((2, 4096), np.uint8))
    meta = cuda.to_device(np.zeros((2, 8), np.int32))
    with pytest.raises(ValueError, match="multiples of 16"):
        launch_q8_gate_up(
            cuda.to_device(np.zeros((1, 40), np.float32)),
            W,
            meta,
            24,
            40,
            cuda.to_device(np.zeros((1, 24), np.float32)),
            ids=cuda.to_device(np.zeros((1, 1), np.int32)),
        )
    with pytest.raises(ValueError, match="meta"):
        launch_q8_gate_up(
            cuda.to_device(np.zeros((1, 32), np.float32)),
            W,
            cuda.to_device(np.zeros((3, 8), np.int32)),
            16,
            32,
            cuda.to_device(np.zeros((1, 16), np.float32)),
            ids=cuda.to_device(np.zeros((1, 1), np.int32)),
        )
    with pytest.raises(ValueError, match="kinds"):  # a (code, scheme) pair no expert can have
        launch_q8_down(
            cuda.to_device(np.zeros((1, 16), np.float32)),
            W,
            meta,
            16,
            32,
            cuda.to_device(np.zeros((1, 32), np.float32)),
            ids=cuda.to_device(np.zeros((1, 1), np.int32)),
            kinds=[(q.CODE_BF16, q.SCALE_CHANNEL)],
        )
    two = np.array([[q.CODE_INT8, q.SCALE_CHANNEL] + [0] * 6, [q.CODE_BF16, q.SCALE_NONE] + [0] * 6] * 2, np.int32)
    assert layer_kinds(two) == ((q.CODE_BF16, q.SCALE_NONE), (q.CODE_INT8, q.SCALE_CHANNEL))
    assert set(layer_kinds(two)) < set(ALL_KINDS)
    with pytest.raises(ValueError, match="slot_of"):  # a slot map of the wrong dtype
        launch_q8_down(
            cuda.to_device(np.zeros((1, 16), np.float32)),
            W,
            meta,
            16,
            32,
            cuda.to_device(np.zeros((1, 32), np.float32)),
            offsets=cuda.to_device(np.zeros(3, np.int32)),
            slot_of=cuda.to_device(np.zeros(2, np.int64)),
        )


@pytest.mark.parametrize("kind", [(q.CODE_INT8, q.SCALE_CHANNEL), (q.CODE_FP8, q.SCALE_BLOCK)])  # both scale schemes
def test_a_shared_layout_given_at_launch_gives_the_meta_reads_bits(kind):
    """A layer whose experts share one block layout (one encoding): its meta row given at launch stands for the
    device reads, bit for bit, by slot (through the slot map too) and grouped; with it given the device meta is
    not read (rows of another encoding and wrong offsets there change nothing), without it it is (the wrong
    offsets alone change the results)."""
    F, D, T, K, E = 32, 32, 3, 2, 4
    rng = np.random.default_rng(17 + kind[0] * 3 + kind[1])
    W, meta, _ = mixed_layer(rng, [kind] * E, F, D)
    layout = q.shared_layout(meta)
    assert layout == tuple(int(v) for v in meta[0])
    # gate and up swapped, down pointing at gate: in range, finite; `garbled` also names another encoding
    wrong = np.ascontiguousarray(meta[:, [0, 1, 3, 2, 2, 6, 5, 5]])
    garbled = wrong.copy()
    garbled[:, 0] = q.CODE_FP8 if kind[0] == q.CODE_INT8 else q.CODE_INT8
    kinds = layer_kinds(meta)
    ids = np.array([[3, 1], [0, 3], [2, 1]], np.int32)
    x = cuda.to_device(rng.standard_normal((T, D)).astype(np.float32))
    groups = group_by_expert(ids, E)
    order, offsets = cuda.to_device(groups.order.astype(np.int32)), cuda.to_device(groups.offsets.astype(np.int32))
    slot_of = np.array([2, 0, 3, 1], np.int32)
    slots = np.empty_like(W)
    slots[slot_of] = W

    def run(device_meta, given, how):
        h = cuda.to_device(np.full((T * K if how == "grouped" else K, F), np.nan, np.float32))
        y = cuda.to_device(np.full((h.shape[0], D), np.nan, np.float32))
        args = dict(kinds=kinds, layout=layout if given else None)
        if how == "grouped":
            args.update(offsets=offsets)
            src = x
        else:
            args.update(ids=cuda.to_device(ids[:1]))
            src = x[:1]
        buffer = cuda.to_device(W)
        if how == "slots":
            args.update(slot_of=cuda.to_device(slot_of))
            buffer = cuda.to_device(slots)
        dmeta = cuda.to_device(device_meta)
        launch_q8_gate_up(src, buffer, dmeta, F, D, h, **({"order": order} if how == "grouped" else {}), **args)
        launch_q8_down(h, buffer, dmeta, F, D, y, **args)
        return h.copy_to_host(), y.copy_to_host()

    for how in ("slot", "slots", "grouped"):
        read, given, misread = run(meta, False, how), run(garbled, True, how), run(wrong, False, how)
        for a, b in zip(read, given):
            assert np.isfinite(a).all() and np.array_equal(a, b), how
        assert np.isfinite(misread[0]).all() and not np.array_equal(misread[0], read[0]), how


def test_shared_layout_and_its_refusals():
    F, D = 32, 32
    rng = np.random.default_rng(23)
    _, mixed, _ = mixed_layer(rng, [(q.CODE_INT8, q.SCALE_CHANNEL), (q.CODE_FP8, q.SCALE_CHANNEL)], F, D)
    assert q.shared_layout(mixed) is None  # two encodings: each expert's row read on the device
    _, same, _ = mixed_layer(rng, [(q.CODE_INT8, q.SCALE_CHANNEL)] * 2, F, D)
    layout = q.shared_layout(same)
    W, x = cuda.to_device(np.zeros((2, 8192), np.uint8)), cuda.to_device(np.zeros((1, D), np.float32))
    h, ids = cuda.to_device(np.zeros((1, F), np.float32)), cuda.to_device(np.zeros((1, 1), np.int32))
    common = (x, W, cuda.to_device(same), F, D, h)
    with pytest.raises(ValueError, match="layout: its encoding"):  # a kernel of several encodings takes none
        launch_q8_gate_up(*common, ids=ids, layout=layout)
    with pytest.raises(ValueError, match="layout: its encoding"):
        launch_q8_gate_up(*common, ids=ids, kinds=[(q.CODE_FP8, q.SCALE_CHANNEL)], layout=layout)
    with pytest.raises(TypeError, match="layout: a tuple"):
        launch_q8_gate_up(*common, ids=ids, kinds=layer_kinds(same), layout=np.array(layout))
    bad = (q.CODE_INT8, q.SCALE_CHANNEL, 8, *layout[3:])
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        launch_q8_gate_up(*common, ids=ids, kinds=layer_kinds(same), layout=bad)
    bad_scale = (*layout[:5], layout[5] + 2, *layout[6:])
    with pytest.raises(ValueError, match="the scales' of 4"):
        launch_q8_gate_up(*common, ids=ids, kinds=layer_kinds(same), layout=bad_scale)
