"""bench/kernels.py's host-side parts (the bench itself needs a GPU): expert id sets, summaries, arguments."""

from __future__ import annotations

import numpy as np
from numba import cuda

from bench import kernels


def test_expert_sets_are_c_contiguous_sorted_distinct():
    sets = kernels.expert_sets(np.random.default_rng(0), 128, 8, 8)
    assert len(sets) == 8
    for ids in sets:
        assert ids.shape == (1, 8) and ids.dtype == np.int32 and ids.flags["C_CONTIGUOUS"]
        # a [None] view has strides (0, 4): Numba's device reshape refuses it on the GPU
        assert ids.strides == (8 * 4, 4)
        assert np.all(np.diff(ids[0]) > 0) and 0 <= ids.min() and ids.max() < 128


def test_expert_reference_rows_line_up():
    """gemv's expert outputs (slot order) equal moe_ffn's (grouped order) for expert_sets' ids, so the
    bench's diff compares row by row (simulator, bf16, tiny shapes)."""
    from expert_service.experts.grouping import group_by_expert
    from expert_service.kernels.gemv import launch_expert_down, launch_expert_gate_up
    from expert_service.kernels.moe_ffn import launch_moe_down, launch_moe_gate_up

    rng = np.random.default_rng(1)
    E, K, F, D = 4, 2, 8, 40
    ids = kernels.expert_sets(rng, E, K, 1)[0]
    bits = (rng.standard_normal((E, 3 * F * D)).astype(np.float32) * 0.2).view(np.uint32) >> 16
    experts = cuda.to_device(bits.astype(np.uint16))
    x = cuda.to_device(rng.standard_normal((1, D)).astype(np.float32))
    groups = group_by_expert(ids, E)
    order, offsets = cuda.to_device(groups.order.astype(np.int32)), cuda.to_device(groups.offsets.astype(np.int32))
    h, h_ref = cuda.device_array((K, F), np.float32), cuda.device_array((K, F), np.float32)
    y, y_ref = cuda.device_array((K, D), np.float32), cuda.device_array((K, D), np.float32)
    d_ids = cuda.to_device(ids)
    launch_expert_gate_up(x, d_ids, experts, F, D, h)
    launch_moe_gate_up(x, order, offsets, experts, F, D, h_ref)
    launch_expert_down(h_ref, d_ids, experts, F, D, y)
    launch_moe_down(h_ref, order, offsets, experts, F, D, y_ref)
    assert kernels.rel_diff(h.copy_to_host(), h_ref.copy_to_host()) < 1e-5
    assert kernels.rel_diff(y.copy_to_host(), y_ref.copy_to_host()) < 1e-5


def test_summary_and_row():
    assert abs(kernels.rel_diff(np.array([1.0, 2.1]), np.array([1.0, 2.0])) - 0.05) < 1e-12
    r = kernels.summarize(4_300_000, "torch", 2e-6, 3e-6, 1e-2, 4.3e12)
    assert abs(r["gemv_TB_per_s"] - 2.15) < 1e-9 and abs(r["ref_TB_per_s"] - 4.3 / 3) < 1e-9
    assert abs(r["ratio"] - 1.5) < 1e-9
    assert abs(r["gemv_roofline"] - 0.5) < 1e-9 and abs(r["ref_roofline"] - 1 / 3) < 1e-9
    assert r["gemv_ms"] == 2e-3 and r["max_rel_diff"] == 1e-2
    line = kernels.format_row("qwen3", "lm_head", r)
    assert line.startswith("qwen3") and "lm_head" in line and "x 1.50" in line and "roofline 0.50" in line


def test_arguments():
    args = kernels.parse_args(["--gemv", "--sweep", "--out", "o.json"])  # old command line still parses
    assert args.sweep and args.out == "o.json" and args.repeats == 20 and args.hbm_bytes_per_s is None
    assert kernels.parse_args([]).out == "out/kernels.json"
    assert kernels.parse_args(["--hbm-bytes-per-s", "4.3e12"]).hbm_bytes_per_s == 4.3e12
