"""Decode attention's split-K parts per step (CudaOptions.decode_splits_per_step, GPU only): with the option on, a
decode step of S sequences takes decode_splits(S) parts instead of the largest batch's, and each sequence uses as
many as its context needs; with decode_part_keys 32 too, parts of one key tile (a 70-token context: 3 parts, not 2;
one sequence over 100: 4, not 2), the value reaching every decode-attention launch. Long prompts (so every allowed
part is used) decoded for a few steps, one sequence and three, on an fp32 model (attention_decode) and a bf16 one
(attention_decode_tiled at one sequence, the tensor-core kernel at three): against the option off, the same greedy tokens and logits within float32 rounding (fp32; only the
order of the softmax sums differs) or the first decode's logits within bf16 tolerance (bf16: later tokens may part
at a near tie); graph replay equal to eager passes bit for bit."""

import numpy as np
import pytest

from common.model_format import ModelDir
from expert_service.backends import build_engine
from expert_service.cuda import model as cuda_model
from expert_service.cuda.workspace import decode_split_count
from expert_service.engine.config import EngineConfig
from expert_service.engine.cuda_options import CudaOptions
from expert_service.engine.engine import PrefillInput
from expert_service.engine.sampling import SamplingParams
from expert_service.tools.tiny_model import make_tiny
from tests.helpers import bf16_tiny, random_prompt, rel_error
from tests.spy import Spy

pytestmark = pytest.mark.gpu

# 128 sequences at most: the largest batch's P is small, one sequence's is the model's cap (its longest context in
# parts of 256 keys)
CFG = dict(kv_block_size=16, kv_cache_tokens=8192, max_batch_tokens=1024, max_batch_size=128)
PROMPTS = {1: (900,), 3: (900, 70, 530)}
SHORT = {1: (100,), 3: (900, 70, 530)}  # the tile parts' prompts: one sequence over a short context
DECODES = 3
ON = {
    "per_step": CudaOptions(decode_splits_per_step=True),
    "per_step_tile_parts": CudaOptions(decode_splits_per_step=True, decode_part_keys=32),
}


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def model(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("splits-" + request.param)
    if request.param == "bf16":
        return request.param, bf16_tiny(root, "qwen3_moe", 7, head_dim=64)  # head size the bf16 kernels take
    return request.param, make_tiny(root / "m", family="qwen3_moe", seed=7)


def open_engine(path, **overrides):
    return build_engine(ModelDir.open(path), EngineConfig(**{**CFG, "backend": "cuda", **overrides}))


ATTENTION_LAUNCHERS = ("launch_attention_decode_fastest", "launch_attention_decode", "launch_attention_decode_mma")


def part_keys(spies) -> set[int]:
    """The min_keys the spied decode-attention launches took since the last call (eager steps), then forgets them."""
    keys = {kwargs["min_keys"] for spy in spies for kwargs in spy.kwargs}
    assert keys, "no decode-attention launch"
    for spy in spies:
        spy.kwargs.clear()
    return keys


def decode(engine, lengths):
    """Prefill the prompts (one per step, each within the step budget), then DECODES steps of all of them:
    per decode step (tokens, logits [S, V])."""
    rids = list(range(len(lengths)))
    for r, n in zip(rids, lengths):
        engine.step([PrefillInput(r, np.array(random_prompt(70 + r, n)), SamplingParams(), True)])
    steps = []
    for _ in range(DECODES):
        result = engine.step(decode_ids=rids)
        steps.append(([o.token_id for o in result.outputs], np.stack(list(result.logits))))
    engine.clear()
    return steps


@pytest.mark.parametrize("on", sorted(ON))
@pytest.mark.parametrize("seqs", sorted(PROMPTS))
def test_per_step_parts_equal_the_largest_batchs(model, seqs, on, monkeypatch):
    dtype, model = model
    config = open_engine(model, cuda_graphs=False).model_config
    assert decode_split_count(config, seqs) > decode_split_count(config, CFG["max_batch_size"])  # a real change
    prompts = (SHORT if on == "per_step_tile_parts" else PROMPTS)[seqs]
    eager = open_engine(model, cuda_graphs=False, cuda_options=ON[on])
    launches = [Spy(monkeypatch, cuda_model, name) for name in ATTENTION_LAUNCHERS]
    per_step = decode(eager, prompts)
    assert part_keys(launches) == {ON[on].decode_part_keys}
    eager.decoder.set_options(CudaOptions())
    fixed = decode(eager, prompts)
    assert part_keys(launches) == {CudaOptions().decode_part_keys}
    compared = per_step if dtype == "fp32" else per_step[:1]
    for i, ((tokens, logits), (want_tokens, want)) in enumerate(zip(compared, fixed)):
        assert rel_error(logits, want) <= (1e-4 if dtype == "fp32" else 1e-2), f"{dtype}, {seqs} sequences, decode {i}"
        assert dtype != "fp32" or tokens == want_tokens, f"{seqs} sequences, decode {i}"
    graphs = open_engine(model, cuda_options=ON[on])
    replayed = decode(graphs, prompts)
    assert graphs.decoder.graphs, "decode steps did not replay a graph"
    for i, ((tokens, logits), (want_tokens, want)) in enumerate(zip(replayed, per_step)):
        assert tokens == want_tokens and np.array_equal(logits, want), f"{dtype}, {seqs} sequences, decode {i}: replay"
