"""Sessions shared by the expert-cache tests of both backends: the same steps at any cache size."""
import numpy as np

from common.model_format import ModelDir
from common.routing_plan import RoutingPlan
from expert_service.config import EngineConfig
from expert_service.engine import Engine, PrefillInput
from expert_service.sampling import SamplingParams

PROMPTS = (np.arange(5, 29) % 250 + 3, np.array([7, 100, 42, 9, 9, 13, 200]))


def run_session(model: ModelDir, plans=None, backend="cpu", prompts=PROMPTS, **overrides):
    """Prompts in one step, then 4 decodes: (logits of every step, tokens, per-step stats, traces, engine)."""
    engine = Engine(model, EngineConfig(backend=backend, kv_block_size=4, **overrides))
    greedy = SamplingParams()
    steps = [dict(prefill=[PrefillInput(i, p, greedy, True) for i, p in enumerate(prompts)])]
    steps += [dict(decode_ids=list(range(len(prompts))))] * 4
    logits, tokens, stats, traces = [], [], [], []
    for n, step in enumerate(steps):
        result = engine.step(**step, routing_plan=plans[n] if plans else None)
        logits.append(np.stack(list(result.logits)))
        tokens.append([o.token_id for o in result.outputs])
        stats.append(result.expert_cache)
        traces.append(result.trace)
    return logits, tokens, stats, traces, engine


def exact_plans(traces, num_experts=4):
    """The exact routing of each step as routing plans (CSR per MoE layer)."""
    return [RoutingPlan.from_expert_ids(list(trace.expert_ids), np.stack(list(trace.expert_ids.values())),
                                        num_experts) for trace in traces]
