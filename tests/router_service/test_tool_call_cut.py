"""A reply cut inside a call (a stop string matching in its JSON, or EOS there) keeps the cut call's markup as
content, as the parser treats any call that does not parse, and its finish_reason is the reason that cut it, not
"tool_calls": a stop string inside a second parallel call gave "tool_calls" with the cut markup in the content."""

from __future__ import annotations

import asyncio
import json
import random
import types

import pytest

from router_service.scheduler import FinishReason
from router_service.tool_calls import MISTRAL_MARKER
from router_service.tool_replies import ToolReply, collect_reply
from router_service.tool_request import ToolRequest

TOOLS = ToolRequest(tools=({"name": "get_weather"}, {"name": "add"}))


def _call() -> dict:
    name = random.choice(["get_weather", "add"])
    return {"name": name, "arguments": {random.choice("xyz"): random.randint(0, 999)}}


def _reply(fmt: str, calls: list[dict], cut_call: dict | None, cut: float) -> tuple[str, str]:
    """(the reply's text, the markup of the cut call, which the content must hold)."""
    if fmt == "hermes":
        whole = "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in calls)
        if cut_call is None:
            return whole, ""
        markup = f"<tool_call>\n{json.dumps(cut_call)}"
    else:
        whole = MISTRAL_MARKER + "[" + ", ".join(json.dumps(c) for c in calls)
        if cut_call is None:
            return whole + "]", ""
        markup = ", " + json.dumps(cut_call)
    # cut inside the call's JSON: past its opening, before its last character
    start = markup.index("{") + 1
    markup = markup[: start + int(cut * (len(markup) - 1 - start))]
    return whole + markup, markup


async def _collect(reply: ToolReply, text: str, reason: FinishReason):
    """The reply fed in random pieces, as a stream's Deltas come."""
    cuts = sorted(random.sample(range(1, len(text)), min(4, len(text) - 1)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]

    async def deltas():
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield types.SimpleNamespace(
                text=piece, token_ids=[1], logprobs=[], top_logprobs=[], prompt_logprobs=None,
                finish_reason=reason if last else None,
            )  # fmt: skip

    return await collect_reply(deltas(), reply)


@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
@pytest.mark.parametrize("reason", [FinishReason.STOP_SEQUENCE, FinishReason.EOS])
def test_a_reply_cut_inside_a_later_call_does_not_finish_as_tool_calls(fmt, reason):
    calls = [_call() for _ in range(random.randint(1, 3))]
    text, markup = _reply(fmt, calls, _call(), random.random())
    reply = ToolReply(TOOLS, fmt)
    out = asyncio.run(_collect(reply, text, reason))
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [(c["name"], c["arguments"]) for c in calls]
    assert markup.strip() in out.text and out.ended_in_call
    assert reply.finish_reason(reason) is None  # the front then says "stop", as for a reply without calls


@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
def test_calls_complete_before_the_stop_string_finish_as_tool_calls(fmt):
    calls = [_call() for _ in range(random.randint(1, 3))]
    text, _ = _reply(fmt, calls, None, 0.0)
    reply = ToolReply(TOOLS, fmt)
    out = asyncio.run(_collect(reply, text + "\nObserv", FinishReason.STOP_SEQUENCE))
    assert len(out.tool_calls) == len(calls) and not out.ended_in_call
    assert reply.finish_reason(FinishReason.STOP_SEQUENCE) == "tool_calls"
