"""Penalties on the host: parameters, slots, a step's PenaltyBatch, the state words and the numpy reference, against
transformers' RepetitionPenaltyLogitsProcessor and an independent presence/frequency reference (OpenAI's
formula over output-token counts), through the cpu backend's HostPenalties over several steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from common.errors import CapacityError, InvalidRequestError
from expert_service.cpu.penalties import HostPenalties
from expert_service.engine.penalties import SATURATED, PenaltyParams, PenaltySlots, apply_penalties

VOCAB = 97


def presence_frequency_reference(logits: np.ndarray, output_tokens, presence: float, frequency: float) -> np.ndarray:
    """mu[j] -= c[j] * frequency + (c[j] > 0) * presence, c counted token by token over the output."""
    out = logits.astype(np.float64).copy()
    counts = {}
    for t in output_tokens:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        out[t] -= c * frequency + presence
    return out


def hf_repetition(logits: np.ndarray, seen_tokens, penalty: float) -> np.ndarray:
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    return processor(torch.tensor([list(seen_tokens)]), torch.tensor(logits[None, :])).numpy()[0]


def expected(logits, prompt, output, params: PenaltyParams) -> np.ndarray:
    """transformers' repetition over prompt + output, then presence/frequency over the output."""
    x = hf_repetition(logits, list(prompt) + list(output), params.repetition) if params.repetition != 1 else logits
    return presence_frequency_reference(x, output, params.presence, params.frequency)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(repetition=0.0), "repetition_penalty"),
        (dict(repetition=-1.0), "repetition_penalty"),
        (dict(repetition=float("inf")), "repetition_penalty"),
        (dict(repetition=float("nan")), "repetition_penalty"),
        (dict(presence=2.5), "presence_penalty"),
        (dict(presence=float("nan")), "presence_penalty"),
        (dict(frequency=-2.01), "frequency_penalty"),
    ],
)
def test_invalid_parameters_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        PenaltyParams(**kwargs)
    assert e.value.field == field


def test_bounds_are_accepted_and_active_only_when_something_applies():
    assert not PenaltyParams().active
    assert PenaltyParams(presence=-2.0, frequency=2.0).active and PenaltyParams(repetition=1e-3).active


def test_reference_equals_transformers_repetition_and_openai_presence_frequency():
    rng = np.random.default_rng()
    for _ in range(5):
        logits = (rng.standard_normal(VOCAB) * 3).astype(np.float32)
        prompt, output = rng.integers(0, VOCAB, 30), rng.integers(0, VOCAB, 25)
        params = PenaltyParams(float(rng.uniform(0.3, 3)), float(rng.uniform(-2, 2)), float(rng.uniform(-2, 2)))
        words = np.zeros(VOCAB, np.uint16)
        words[prompt] |= 1
        np.add.at(words, output, 2)
        got = apply_penalties(
            logits[None],
            words[None],
            np.float32([params.repetition]),
            np.float32([params.presence]),
            np.float32([params.frequency]),
        )[0]
        np.testing.assert_allclose(got, expected(logits, prompt, output, params), rtol=1e-5, atol=1e-5)


def _run_steps(rng, penalties_of, prompts, steps: int, chunk: int):
    """Runs prompts (chunked) then decodes through PenaltySlots + HostPenalties; after each step checks every
    sampling row against transformers + the presence/frequency reference over what the sequence saw so far."""
    host = HostPenalties(4, VOCAB)
    slots = PenaltySlots(4)
    seen_prompt = {rid: [] for rid in prompts}
    outputs = {rid: [] for rid in prompts}
    pos = {rid: 0 for rid in prompts}
    for rid, params in penalties_of.items():
        if params.active:
            slots.acquire(rid)
    started = set()
    for _ in range(steps):
        builder = slots.builder()
        rows = []
        for rid, prompt in prompts.items():
            if rid not in started:
                started.add(rid)
                if rid in slots.slots:
                    builder.reset(slots.slots[rid])
            if pos[rid] < len(prompt):
                part = prompt[pos[rid] : pos[rid] + chunk]
                builder.prompt(rid, part)
                seen_prompt[rid] += list(part)
                pos[rid] += len(part)
                if pos[rid] < len(prompt):
                    continue
            elif outputs[rid]:
                builder.output(rid, outputs[rid][-1])
            builder.row(rid, penalties_of[rid])
            rows.append(rid)
        batch = builder.build()
        logits = (rng.standard_normal((len(rows), VOCAB)) * 3).astype(np.float32)
        processed = host.apply(batch, logits) if batch is not None else None
        for r, rid in enumerate(rows):
            got = processed[r] if processed is not None else logits[r]
            want = expected(logits[r], seen_prompt[rid], outputs[rid], penalties_of[rid])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            # the next token: often a repeat, so counts above one occur
            outputs[rid].append(
                int(rng.choice(outputs[rid][-3:])) if outputs[rid] and rng.random() < 0.5 else int(np.argmax(got))
            )
    return host, slots


def test_host_penalties_over_steps_match_the_references():
    rng = np.random.default_rng()
    prompts = {10: rng.integers(0, VOCAB, 13), 11: rng.integers(0, VOCAB, 4), 12: rng.integers(0, VOCAB, 9)}
    penalties_of = {10: PenaltyParams(1.4, 0.5, 0.3), 11: PenaltyParams(), 12: PenaltyParams(0.7, -1.0, 1.5)}
    _run_steps(rng, penalties_of, prompts, steps=12, chunk=5)


def test_unpenalised_steps_build_nothing_and_slots_are_bounded():
    slots = PenaltySlots(2)
    builder = slots.builder()
    builder.prompt(1, np.arange(5))
    builder.output(2, 3)
    builder.row(1, PenaltyParams())
    assert builder.build() is None  # the common path: no penalty work at all
    slots.acquire(1)
    slots.acquire(2)
    with pytest.raises(CapacityError):
        slots.acquire(3)
    slots.release(1)
    assert slots.acquire(3) in (0, 1)


def test_a_reused_slot_starts_from_zero():
    rng = np.random.default_rng()
    host, slots = HostPenalties(1, VOCAB), PenaltySlots(1)
    params = PenaltyParams(2.0, 1.0, 1.0)
    for rid in (1, 2):
        builder = slots.builder()
        builder.reset(slots.acquire(rid))
        prompt = rng.integers(0, VOCAB, 6)
        builder.prompt(rid, prompt)
        builder.row(rid, params)
        logits = rng.standard_normal((1, VOCAB)).astype(np.float32)
        got = host.apply(builder.build(), logits)[0]
        np.testing.assert_allclose(got, expected(logits[0], prompt, [], params), rtol=1e-6)
        slots.release(rid)


def test_counts_saturate_instead_of_wrapping():
    host, slots = HostPenalties(1, VOCAB), PenaltySlots(1)
    slot = slots.acquire(0)
    host.words[slot, 5] = SATURATED
    builder = slots.builder()
    builder.output(0, 5)
    builder.row(0, PenaltyParams(frequency=1.0))
    logits = np.zeros((1, VOCAB), np.float32)
    got = host.apply(builder.build(), logits)
    assert host.words[slot, 5] == SATURATED and got[0, 5] == -(SATURATED >> 1)
