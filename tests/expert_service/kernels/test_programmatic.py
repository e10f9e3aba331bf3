"""kernels/programmatic.py: the launch mode is per thread and restored on exit; inside it launchers build the
waiting variants, which compute the plain kernels' bits (the simulator runs the wait as nothing, so these check
the variants' code paths; the sm_90 order of their loads is test_compile_sm90's, the edges the GPU tests')."""

import threading

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels import programmatic
from expert_service.kernels.embedding import launch_embedding
from expert_service.kernels.gemv import launch_gemv
from expert_service.kernels.moe_combine import launch_moe_combine
from expert_service.kernels.numeric import SIMULATOR
from expert_service.kernels.rmsnorm import launch_rmsnorm

pytestmark = pytest.mark.skipif(not SIMULATOR and not cuda.is_available(), reason="needs the CUDA simulator or a GPU")


def test_the_mode_nests_restores_and_stays_on_its_thread():
    assert not programmatic.active()
    seen = []
    with programmatic.launches(True):
        assert programmatic.active()
        other = threading.Thread(target=lambda: seen.append(programmatic.active()))
        other.start()
        other.join()
        with programmatic.launches(False):
            assert not programmatic.active()
        assert programmatic.active()
        with pytest.raises(RuntimeError), programmatic.launches(True):
            raise RuntimeError("a failed issue")
        assert programmatic.active()
    assert not programmatic.active() and seen == [False]


def bf16(values):
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


@pytest.mark.parametrize("case", ["rmsnorm", "gemv", "embedding", "moe_combine"])
def test_waiting_variants_compute_the_plain_bits(case):
    rng = np.random.default_rng(11)
    if case == "rmsnorm":
        x, w = rng.standard_normal((3, 96)).astype(np.float32), rng.standard_normal(96).astype(np.float32)
        args, out = (cuda.to_device(x), cuda.to_device(w), 1e-6), (3, 96)

        def launch(o):
            launch_rmsnorm(*args, o)
    elif case == "gemv":
        x, w = rng.standard_normal((1, 256)).astype(np.float32), bf16(rng.standard_normal((40, 256)))
        args, out = (cuda.to_device(x), cuda.to_device(w)), (1, 40)

        def launch(o):
            launch_gemv(*args, o)
    elif case == "embedding":
        ids, table = rng.integers(0, 50, 5).astype(np.int32), bf16(rng.standard_normal((50, 64)))
        args, out = (cuda.to_device(ids), cuda.to_device(table)), (5, 64)

        def launch(o):
            launch_embedding(*args, o)
    else:
        y, weights = rng.standard_normal((6, 48)).astype(np.float32), rng.random((3, 2)).astype(np.float32)
        position = rng.permutation(6).astype(np.int32)
        h0 = rng.standard_normal((3, 48)).astype(np.float32)
        args, out = (cuda.to_device(y), cuda.to_device(position), cuda.to_device(weights)), None

        def launch(o):
            launch_moe_combine(*args, o)

    def run(wait: bool) -> np.ndarray:
        o = cuda.to_device(h0.copy()) if out is None else cuda.to_device(np.full(out, np.nan, np.float32))
        before = programmatic.waiting_functions()
        with programmatic.launches(wait):
            launch(o)
        built = programmatic.waiting_functions() - before
        assert not built or wait, f"{case}: a waiting variant built outside the mode"
        return o.copy_to_host()

    plain, waiting = run(False), run(True)
    assert np.isfinite(plain).all(), f"{case}: some output was not written"
    assert np.array_equal(plain, waiting), f"{case}: the waiting variant's bits differ"
    assert any(f.__name__.startswith(case.split("_")[0]) for f in programmatic.waiting_functions()), case
