"""The router's wire: scheduled steps out as step-stream messages, the worker's packed answers back as outputs."""

import numpy as np
import pytest

from common.pb import router_pb2
from common.pb import worker_pb2 as pb
from common.routing_plan import RoutingPlan
from expert_service.serving import wire as worker_wire
from expert_service.serving.step_stream import StepLimits
from router_service import wire
from router_service.config import RouterConfig
from router_service.scheduler import FinishReason, RequestOutput, ScheduledRequest, Scheduler, SchedulerLimits
from router_service.validation import ModelLimits, validate_request


def test_step_request_carries_frees_chunks_decodes_and_plan_as_the_worker_reads_them():
    """Sampling rides on a request's first chunk only, decodes ride along, frees come first, the routing plan
    travels inside; the worker's own decoder reads back exactly what was scheduled."""
    s = Scheduler(SchedulerLimits(8, 6, 4, 64))
    s.add(ScheduledRequest(1, [1, 2, 3], 4, sampling=pb.SamplingParams(seed=11)))
    s.add(ScheduledRequest(2, [1, 2, 3, 4, 5], 4, sampling=pb.SamplingParams(seed=12)))
    step = s.schedule()  # 1: whole prompt, 2: first 3 tokens
    request = wire.step_request(step, 5)
    assert request.step_id == 5 and not request.HasField("routing_plan") and not request.free_request_ids
    assert [(c.request_id, list(c.token_ids), c.is_last, c.sampling.seed) for c in request.chunks] == [
        (1, [1, 2, 3], True, 11),
        (2, [1, 2, 3], False, 12),
    ]
    s.update(step, [RequestOutput(1, 9, -0.5), RequestOutput(2, None)])
    step = s.schedule()  # 1 decodes, 2's last 2 tokens start at 3: the worker reads where each chunk starts
    back = worker_wire.step_request(wire.step_request(step, 6), StepLimits((0,), 16, 8))
    assert [(c.request_id, c.start_position, c.sampling) for c in back.chunks] == [(2, 3, None)]
    s.update(step, [RequestOutput(1, 9, -0.5), RequestOutput(2, 4, -0.5)])
    s.finish(2, FinishReason.CANCELLED)
    step = s.schedule()  # 1 decodes; 2 left, so the step frees it first
    plan = RoutingPlan((0,), np.array([[0, 1]], np.int32), np.array([[0]], np.int32))
    message = pb.StepStreamRequest.FromString(wire.step_request(step, 7, plan).SerializeToString())
    limits = StepLimits((0,), 16, 8)
    back = worker_wire.step_request(message, limits)
    assert back.step_id == 7 and back.free_ids.tolist() == [2] and back.decode_ids.tolist() == [1] and not back.chunks
    assert back.routing_plan.expert_ids(1, 1)[0].tolist() == [[0]]


def test_sampling_params_stop_ids_are_eos_then_stop_tokens():
    config = RouterConfig(max_new_tokens=100, default_max_new_tokens=20)
    limits = ModelLimits(vocab_size=258, max_sequence_length=64, kv_capacity_tokens=1000, eos_token_ids=(256,))

    def validated(**params):
        request = router_pb2.GenerateRequest(parameters=router_pb2.SamplingParameters(**params))
        request.token_ids.ids.extend([1, 2, 3])
        return validate_request(request, config, limits, None)

    p = wire.sampling_params(
        validated(temperature=0.5, top_k=3, stop_token_ids=[7, 2], min_new_tokens=2, seed=5), eos_token_ids=[2, 0]
    )
    assert list(p.stop_token_ids) == [2, 0, 7] and p.min_new_tokens == 2 and p.seed == 5 and p.top_k == 3
    assert p.temperature == pytest.approx(0.5) and not p.HasField("prompt_logprobs")
    assert list(
        wire.sampling_params(validated(stop_token_ids=[7], ignore_eos=True), eos_token_ids=[2]).stop_token_ids
    ) == [7]


def test_min_p_and_logit_bias_travel_from_the_router_request_to_the_worker_params():
    config = RouterConfig(max_new_tokens=100, default_max_new_tokens=20)
    limits = ModelLimits(vocab_size=258, max_sequence_length=64, kv_capacity_tokens=1000)
    request = router_pb2.GenerateRequest(
        parameters=router_pb2.SamplingParameters(temperature=0.7, min_p=0.125, logit_bias={200: -100.0, 3: 2.5})
    )
    request.token_ids.ids.extend([1, 2, 3])
    message = wire.sampling_params(validate_request(request, config, limits, None), eos_token_ids=[])
    back = worker_wire.sampling_params(pb.SamplingParams.FromString(message.SerializeToString()))
    assert back.min_p == 0.125 and back.logit_bias == ((3, 2.5), (200, -100.0))
    assert (
        worker_wire.sampling_params(
            wire.sampling_params(
                validate_request(
                    router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1])), config, limits, None
                ),
                eos_token_ids=[],
            )
        ).logit_bias
        == ()
    )


def test_request_outputs_read_packed_answers_errors_and_scores():
    scores = pb.SequenceLogprobs(
        request_id=4,
        sampled=pb.TokenLogprobs(
            top_k=2,
            logprobs=np.array([-0.25], "<f4").tobytes(),
            top_ids=np.array([9, 3], "<i4").tobytes(),
            top_logprobs=np.array([-0.25, -2.0], "<f4").tobytes(),
        ),
    )
    response = pb.StepStreamResponse(
        step_id=3,
        request_ids=np.array([4, 5, 6], "<u8").tobytes(),
        token_ids=np.array([9, -1, -1], "<i4").tobytes(),
        logprobs=np.array([-0.25, 0, 0], "<f4").tobytes(),
        errors=[pb.SequenceError(request_id=6, code="NON_FINITE_LOGITS")],
        scored=[scores],
    )
    four, five, six = wire.request_outputs(response)
    assert (four.request_id, four.token_id, four.logprob) == (4, 9, -0.25)
    assert four.top.top_ids.tolist() == [[9, 3]] and four.prompt is None
    assert five == RequestOutput(5, None, 0.0) and six == RequestOutput(6, None, 0.0, error="NON_FINITE_LOGITS")
    plain = pb.StepStreamResponse(request_ids=np.array([7], "<u8").tobytes(), token_ids=np.array([1], "<i4").tobytes())
    assert wire.request_outputs(plain) == [RequestOutput(7, 1, 0.0)]


def test_request_outputs_refuse_arrays_of_different_lengths():
    response = pb.StepStreamResponse(
        step_id=3, request_ids=np.array([4, 5], "<u8").tobytes(), token_ids=np.array([9], "<i4").tobytes()
    )
    with pytest.raises(ValueError, match="step 3: 2 request ids, 1 tokens"):
        wire.request_outputs(response)


def test_scored_refuses_mismatched_top_arrays():
    message = pb.TokenLogprobs(
        top_k=2,
        logprobs=np.zeros(2, "<f4").tobytes(),
        top_ids=np.zeros(3, "<i4").tobytes(),
        top_logprobs=np.zeros(4, "<f4").tobytes(),
    )
    with pytest.raises(ValueError, match="2 log-probabilities with top_k 2, but 3 ids"):
        wire.scored(message)
