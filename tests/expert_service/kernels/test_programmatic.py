"""kernels/programmatic.py: the launch mode is per thread and restored on exit; inside it launchers build the
waiting variants, which compute the plain kernels' bits (the simulator runs the wait as nothing, so these check
the variants' code paths; the sm_90 order of their loads is test_compile_sm90's, the edges the GPU tests')."""

import threading

import numpy as np
import pytest
from numba import cuda

from expert_service.kernels import programmatic
from expert_service.kernels.embedding import launch_embedding
from expert_service.kernels.gemv import LaunchShape, launch_gemv
from expert_service.kernels.moe_combine import launch_moe_combine
from expert_service.kernels.numeric import SIMULATOR
from expert_service.kernels.rmsnorm import launch_rmsnorm

pytestmark = pytest.mark.skipif(
    not SIMULATOR and not (cuda.is_available() and programmatic.supported()),
    reason="needs the CUDA simulator or an sm_90 GPU",
)


def test_the_level_nests_restores_and_stays_on_its_thread():
    assert programmatic.active() == programmatic.OFF and programmatic.mode() == programmatic.PLAIN
    seen = []
    with programmatic.launches(programmatic.WEIGHTS_FIRST):
        assert (
            programmatic.mode() == programmatic.TRIGGER and programmatic.mode(prefetches=True) == programmatic.PREFETCH
        )
        other = threading.Thread(target=lambda: seen.append(programmatic.active()))
        other.start()
        other.join()
        with programmatic.launches(programmatic.EVERY_KERNEL):
            assert programmatic.mode() == programmatic.mode(prefetches=True) == programmatic.WAIT
        assert programmatic.active() == programmatic.WEIGHTS_FIRST
        with pytest.raises(RuntimeError), programmatic.launches(programmatic.OFF):
            raise RuntimeError("a failed issue")
        assert programmatic.active() == programmatic.WEIGHTS_FIRST
    assert programmatic.active() == programmatic.OFF and seen == [programmatic.OFF]


def test_only_waiting_modes_load_coherently_and_register():
    assert [
        programmatic.waits(m)
        for m in (programmatic.PLAIN, programmatic.WAIT, programmatic.TRIGGER, programmatic.PREFETCH)
    ] == [False, True, False, True]


def bf16(values):
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


@pytest.mark.parametrize("level", [programmatic.EVERY_KERNEL, programmatic.WEIGHTS_FIRST])
@pytest.mark.parametrize("case", ["rmsnorm", "gemv", "gemv_split", "gemv_tail", "embedding", "moe_combine"])
def test_waiting_variants_compute_the_plain_bits(case, level, monkeypatch):
    rng = np.random.default_rng(11)
    if case == "rmsnorm":
        x, w = rng.standard_normal((3, 96)).astype(np.float32), rng.standard_normal(96).astype(np.float32)
        args, out = (cuda.to_device(x), cuda.to_device(w), 1e-6), (3, 96)

        def launch(o):
            launch_rmsnorm(*args, o)
    elif case.startswith("gemv"):
        # the default shape; K split over 4 warps (one holds a partial step only, the others nothing); one warp
        # over K = 584 (73 chunks: a whole step, then a tail)
        k = {"gemv": 256, "gemv_split": 256, "gemv_tail": 584}[case]
        x, w = rng.standard_normal((1, k)).astype(np.float32), bf16(rng.standard_normal((40, k)))
        args, out = (cuda.to_device(x), cuda.to_device(w)), (1, 40)
        shape = {"gemv": None, "gemv_split": LaunchShape(1, 4, 1), "gemv_tail": LaunchShape(1, 1, 4)}[case]

        def launch(o):
            launch_gemv(*args, o, shape=shape)
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

    asked = []  # the variant each launcher was given
    mode = programmatic.mode
    monkeypatch.setattr(programmatic, "mode", lambda *a, **kw: asked.append(mode(*a, **kw)) or asked[-1])

    def run(wait: bool) -> np.ndarray:
        o = cuda.to_device(h0.copy()) if out is None else cuda.to_device(np.full(out, np.nan, np.float32))
        before = programmatic.waiting_functions()
        with programmatic.launches(level if wait else programmatic.OFF):
            launch(o)
        built = programmatic.waiting_functions() - before
        assert not built or wait, f"{case}: a waiting variant built outside the mode"
        return o.copy_to_host()

    plain = run(False)
    assert asked and set(asked) == {programmatic.PLAIN}, (case, asked)
    asked.clear()
    waiting = run(True)
    if level == programmatic.EVERY_KERNEL:
        expected = programmatic.WAIT
    else:
        expected = programmatic.PREFETCH if case.startswith("gemv") else programmatic.TRIGGER
    assert asked and set(asked) == {expected}, (case, level, asked)
    assert np.isfinite(plain).all(), f"{case}: some output was not written"
    assert np.array_equal(plain, waiting), f"{case}: the waiting variant's bits differ"
