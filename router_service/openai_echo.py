"""Completions' `echo`: each choice's text starts with its prompt and, with `logprobs`, its log-probabilities with the
prompt's tokens (the first one's null: nothing predicts it), as OpenAI's legacy completions and vLLM answer; the
scoring pattern `echo` + `logprobs` + `max_tokens: 1` (lm-evaluation-harness's loglikelihood) reads them. The
prompt's scores are the router's prompt_logprobs, which parse_request asks for; router_service/openai_choices.py
serves echo (a stream echoes on each choice's first chunk).
"""

from __future__ import annotations

from router_service.logprobs import PromptLogprob, TokenTexts, Top
from router_service.openai_request import ParsedRequest
from router_service.openai_response import logprobs_field
from router_service.request_state import RequestHandle


def prompt_text(parsed: ParsedRequest, index: int, texts: TokenTexts, handle: RequestHandle) -> str:
    """Prompt `index` (`handle`: one of its samples) as echoed: a text prompt as sent, token ids decoded (special
    tokens left out, as from generated text). A prompt truncate_prompt_tokens cut is the tokens kept, decoded: the
    text as sent would hold a part the model never saw and the echoed logprobs do not score."""
    prompt = parsed.prompts[index]
    if handle.prompt_truncated:
        prompt = list(handle.prompt_ids)
    elif isinstance(prompt, str):
        return prompt
    return texts.tokenizer.decode(prompt) if texts.tokenizer is not None else ""


def with_prompt(
    parsed: ParsedRequest, texts: TokenTexts, entries: list[PromptLogprob] | None, token_ids, logprobs, tops: list[Top]
) -> dict:
    """The completion `logprobs` of the prompt's tokens (`entries`: its scores) followed by the generated ones."""
    entries = entries or []
    ids = [e.token_id for e in entries] + list(token_ids)
    values = [e.logprob for e in entries] + list(logprobs)
    n = parsed.top_logprobs
    scored_tops = [e.top[:n] for e in entries] + list(tops) if n else []
    field = logprobs_field("completion", texts, ids, values, scored_tops)
    if field["top_logprobs"]:  # OpenAI's null for a position with no scores (the prompt's first token)
        field["top_logprobs"] = [None if v is None else t for v, t in zip(values, field["top_logprobs"])]
    return field
