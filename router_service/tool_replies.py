"""A chat reply read through the tool-call parser, for both fronts: each Delta of the request becomes content
text and pieces of calls (router_service.tool_calls), and a unary answer is the same pieces gathered, so a
streamed reply accumulates to exactly the unary one.

Mistral's [TOOL_CALLS] is a special token, which generated text leaves out: the parser gets its text back
wherever the token was generated (each Delta carries the ids behind its text).
"""

from __future__ import annotations

from router_service.frontend import Completion, Frontend
from router_service.scheduler import FinishReason
from router_service.tool_calls import MISTRAL_MARKER, Event, ToolCall, ToolCallDelta, ToolCallParser
from router_service.tool_request import ToolRequest


class ToolReply:
    """One reply's parser; None from `for_request` when the chat offers no callable tools."""

    def __init__(self, tools: ToolRequest, fmt: str, marker_id: int | None = None):
        self.parser = ToolCallParser(fmt, tools.names, tools.parallel)
        self.marker_id = marker_id

    @classmethod
    def for_request(cls, frontend: Frontend, tools: ToolRequest | None) -> ToolReply | None:
        if tools is None or tools.choice == "none" or not tools.tools:
            return None
        marker_id = None
        tokenizer = frontend.batching_loop.tokenizer
        if frontend.tool_format == "mistral" and tokenizer is not None:
            marker_id = tokenizer.token_id(MISTRAL_MARKER)
            if marker_id is not None and tokenizer.decode([marker_id]):
                marker_id = None  # a token the text keeps: the parser sees it there
        return cls(tools, frontend.tool_format, marker_id)

    def feed(self, delta) -> list[Event]:
        """The events of one Delta (and of the reply's end, on its last Delta)."""
        text = delta.text
        if self.marker_id is not None and self.marker_id in delta.token_ids:
            text += MISTRAL_MARKER  # one token per Delta: its text (none) comes before the marker
        events = self.parser.feed(text)
        if delta.finish_reason is not None:
            events += self.parser.finish()
        return events

    @property
    def calls(self) -> list[ToolCall]:
        return self.parser.calls

    def finish_reason(self, reason: FinishReason | None) -> str | None:
        return finish_reason(reason, self.calls, self.parser.ended_in_call)


def split(events: list[Event]) -> tuple[str, list[ToolCallDelta]]:
    """The content text and call pieces of some events."""
    return "".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ToolCallDelta)]


def finish_reason(reason: FinishReason | None, calls: list, ended_in_call: bool = False) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the reply ended on its own after calls; a reply that ended
    inside a call (a stop string in its JSON, max_tokens) keeps the reason that cut it, as with no call."""
    if calls and reason is not None and reason is not FinishReason.LENGTH and not ended_in_call:
        return "tool_calls"
    return None


async def collect_reply(handle, reply: ToolReply) -> Completion:
    """`frontend.collect` through the parser: text is the content, tool_calls the calls."""
    out, text = Completion(), []
    async for delta in handle:
        out.token_ids += delta.token_ids
        text.append(split(reply.feed(delta))[0])
        out.logprobs += delta.logprobs
        out.top_logprobs += delta.top_logprobs
        out.prompt_logprobs = delta.prompt_logprobs if delta.prompt_logprobs is not None else out.prompt_logprobs
        out.finish_reason = delta.finish_reason or out.finish_reason
    out.text = "".join(text)
    out.tool_calls, out.ended_in_call = list(reply.calls), reply.parser.ended_in_call
    return out
