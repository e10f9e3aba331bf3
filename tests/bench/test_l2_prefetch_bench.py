"""bench/l2_prefetch.py in the CUDA simulator: each layer's prefetch asks for exactly the bytes its consumer then
reads (the matrix copy, or the picked experts' blocks or down rows), so the timed difference is the prefetch's."""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

import bench.l2_prefetch as bench
from expert_service.kernels import expert_quant as q
from expert_service.kernels import l2_prefetch


@pytest.fixture
def recorded(monkeypatch):
    calls = []
    monkeypatch.setattr(l2_prefetch, "prefetch_l2_bulk", lambda a, i, n: calls.append((a.size, int(i), int(n))))
    monkeypatch.setattr(bench, "COPIES_BYTES", 1 << 15)
    return calls


def merged(calls):
    out = []
    for _, i, n in sorted(calls, key=lambda c: c[1]):
        if out and out[-1][0] + out[-1][1] == i:
            out[-1][1] += n
        else:
            out.append([i, n])
    return out


@pytest.mark.parametrize("code", [None, q.CODE_INT8])
def test_a_dense_layer_prefetches_its_own_copy(recorded, monkeypatch, code):
    monkeypatch.setitem(bench.MATRICES, "small", (32, 64))
    launch, prefetch, nbytes = bench.dense_case("small", np.random.default_rng(0), cuda.default_stream(), code)
    prefetch(3, 0)
    ((start, size),) = merged(recorded)
    copy = -(-nbytes // 16) * 16
    assert size == copy and start % copy == 0 and start // copy == 3 % (recorded[0][0] // copy)
    launch(3, 0)  # the consumer runs on the same copy's arguments


@pytest.mark.parametrize("code,down_only", [(q.CODE_INT8, False), (q.CODE_INT8, True), (None, True)])
def test_an_expert_layer_prefetches_the_picked_blocks(recorded, code, down_only):
    D, F, E, K = 64, 48, 4, 2
    launch, prefetch, nbytes = bench.experts_case(
        np.random.default_rng(1), cuda.default_stream(), (D, F, E, K), code, down_only
    )
    prefetch(0, 0)
    spans = merged(recorded)
    stride = recorded[0][0] // E  # bytes a block
    item = 2 if code is None else 1
    down = 2 * F * D * item
    lo = down if down_only else 0
    assert len(spans) == K and all(s % stride == lo and n == (nbytes // K) - lo for s, n in spans)
    launch(0, 0)


def test_an_unknown_case_is_one_line(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--smoke", "--cases", "nope", "--out", "/dev/null"])
    assert "--cases: unknown ['nope']" in capsys.readouterr().err
