"""Programmatic dependent launch (CudaOptions.programmatic_launch; GPU only): decode steps launch the kernel
variants that wait for their predecessor, the captured graphs join them by programmatic edges, and every logit
equals the plain kernels' bit for bit, on every family, ragged batches and one sequence, 8-bit models too."""

import numpy as np
import pytest
from numba import cuda

from expert_service.cuda.driver import Graph
from expert_service.engine.cuda_options import CudaOptions
from expert_service.engine.engine import PrefillInput
from expert_service.engine.sampling import SamplingParams
from expert_service.kernels import programmatic
from expert_service.tools.convert import convert
from expert_service.tools.tiny_model import make_tiny
from tests.expert_service.cuda import test_fusions
from tests.expert_service.cuda.test_fusions import assert_bitwise, open_engine, run_steps
from tests.expert_service.tools.head_checkpoint import head_config, write_head_checkpoint
from tests.helpers import random_prompt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not cuda.is_available() or not programmatic.supported(), reason="programmatic launch needs sm_90"
    ),
]

LEVELS = [programmatic.EVERY_KERNEL, programmatic.WEIGHTS_FIRST]
model = test_fusions.model  # every family's tiny model, and a bf16 one with 40 experts (module-scoped fixture)


def programmatic_edges(engine) -> int:
    """Programmatic edges of every captured decode graph of the engine."""
    graphs = engine.decoder.graphs
    return sum(g.programmatic_edges for key in graphs for g in graphs._graphs[key].graphs if isinstance(g, Graph))


def one_sequence(engine, decodes=12):
    """One prompt, then `decodes` one-token steps (graph bucket 1): per step (token, logits)."""
    steps = []
    result = engine.step([PrefillInput(7, np.array(random_prompt(11, 9)), SamplingParams(), True)])
    steps.append(([result.outputs[0].token_id], np.stack(list(result.logits)), None))
    for _ in range(decodes):
        result = engine.step(decode_ids=[7])
        steps.append(([result.outputs[0].token_id], np.stack(list(result.logits)), None))
    engine.clear()
    return steps


def captured_kernel_handles(launch, stream) -> list[tuple[int, int]]:
    """(func, kern) of each kernel node of a raw capture of launch() (what Graph matches against)."""
    from cuda.bindings import driver as drv

    from expert_service.cuda.driver import check, stream_handle

    handle = stream_handle(stream)
    check(drv.cuStreamBeginCapture(handle, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
    launch()
    graph = check(drv.cuStreamEndCapture(handle))
    try:
        nodes = check(drv.cuGraphGetNodes(graph, check(drv.cuGraphGetNodes(graph, 0))[-1]))[0]
        params = [check(drv.cuGraphKernelNodeGetParams(n)) for n in nodes]
        return [(int(p.func), int(getattr(p, "kern", 0))) for p in params]
    finally:
        check(drv.cuGraphDestroy(graph))


def test_two_waiting_norms_in_a_graph_are_joined_by_a_programmatic_edge():
    """The smallest case: two rmsnorms in a row, captured; the second waits for the first through a programmatic
    edge and still reads its output (a norm of the norm, against numpy)."""
    from expert_service.kernels.rmsnorm import launch_rmsnorm

    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 4096)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(4096)).astype(np.float32)
    stream = cuda.stream()
    dx, dw = cuda.to_device(x, stream=stream), cuda.to_device(w, stream=stream)
    mid, out = cuda.device_array_like(dx, stream=stream), cuda.device_array_like(dx, stream=stream)

    def launch():
        launch_rmsnorm(dx, dw, 1e-6, mid, stream=stream)
        launch_rmsnorm(mid, dw, 1e-6, out, stream=stream)

    with programmatic.launches(programmatic.EVERY_KERNEL):
        launch()  # compiles outside the capture
        stream.synchronize()
        graph = Graph(stream)
        with graph:
            launch()
        nodes = captured_kernel_handles(launch, stream)
    assert graph.programmatic_edges == 1, f"handles {sorted(programmatic.handles())}, nodes (func, kern) {nodes}"
    out.copy_to_device(np.full_like(x, np.nan), stream=stream)
    graph.replay()

    def norm(v):
        return v / np.sqrt(np.mean(v.astype(np.float64) ** 2, axis=1, keepdims=True) + 1e-6) * w

    np.testing.assert_allclose(out.copy_to_host(stream=stream), norm(norm(x)), rtol=1e-5, atol=1e-5)
    graph.close()


@pytest.mark.parametrize("level", LEVELS)
def test_waiting_variants_give_the_plain_bits_through_programmatic_edges(model, level):
    name, path = model
    plain = open_engine(path)
    expected, expected_one = run_steps(plain), one_sequence(plain)
    assert programmatic_edges(plain) == 0, name
    engine = open_engine(path, cuda_options=CudaOptions(programmatic_launch=level))
    assert engine.decoder.programmatic_launches == level, name
    assert_bitwise(run_steps(engine), expected, f"{name}: ragged decodes, programmatic vs plain")
    assert_bitwise(one_sequence(engine), expected_one, f"{name}: one sequence, programmatic vs plain")
    edges = programmatic_edges(engine)
    layers = engine.model_config.num_hidden_layers
    # every kernel of a layer, or (weights first) at least its dense projections where they run on the GEMV
    least = 4 * layers if level == programmatic.EVERY_KERNEL else 1
    assert edges >= least, f"{name}: {edges} programmatic edges in the decode graphs"
    assert programmatic.waiting_functions(), name


def test_eight_bit_layers_and_options_switched_on_one_engine(tmp_path):
    """int8 experts, head and attention (moe_q8 and linear_q8's waiting variants); set_options turns the mode on
    and off on one engine, re-capturing the graphs each time, with the same bits throughout."""
    write_head_checkpoint(tmp_path / "hf", head_config("qwen3_moe", tied=True), seed=17)
    q8 = convert(
        tmp_path / "hf",
        tmp_path / "m",
        "bfloat16",
        False,
        expert_dtype="int8",
        head_dtype="int8",
        attention_dtype="int8",
    )
    engine = open_engine(q8)
    expected = one_sequence(engine)
    for level in LEVELS:
        engine.decoder.set_options(CudaOptions(programmatic_launch=level))
        assert_bitwise(one_sequence(engine), expected, f"int8: programmatic level {level} vs plain")
        if level == programmatic.EVERY_KERNEL:  # weights first: the 8-bit GEMVs only let their dependents start
            assert programmatic_edges(engine) > 0
    engine.decoder.set_options(CudaOptions())
    assert_bitwise(one_sequence(engine), expected, "int8: plain again")
    assert programmatic_edges(engine) == 0


def test_engines_with_an_expert_cache_run_the_plain_kernels(tmp_path):
    path = make_tiny(tmp_path / "m", family="mixtral", seed=2)
    engine = open_engine(path, cuda_options=CudaOptions(programmatic_launch=1), expert_cache_slots=2)
    assert not engine.decoder.programmatic_launches
    one_sequence(engine, decodes=3)
    assert programmatic_edges(engine) == 0
