"""Keeping each step message under the worker's receive limit.

A step message (StepStreamRequest) carries everything the scheduler put in the step: prompt chunks (their tokens,
a first chunk's sampling settings, cached-block ids and, for a repetition penalty, the cached prefix's tokens),
decode ids, grammar masks, frees, evictions, block registrations and a routing plan. The worker refuses a message
past its --max-message-bytes (RESOURCE_EXHAUSTED, and every request of the step fails), so the scheduler spends a
byte budget as it builds the step (`StepRoom`): a chunk is cut to the tokens that fit, and an admission, decode or
chunk that does not fit at all waits for the next step. Costs are upper bounds of the serialized sizes (varints
at their longest), and `margin` bytes of the limit are kept back for what is not counted (field tags and lengths,
the step id, the trace context). A constrained decode sent with its input token pending has its grammar mask in the
next message (late masks): that mask counts there only, which reserves it first. `problem` names what is too large
in a request whose own first step cannot fit alone; a cached prefix whose tokens would not fit is used only as far
as they do (the rest is computed again)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import WORKER_MAX_MESSAGE_BYTES

ID_BYTES = 8  # a request or block id in a packed uint64 field
VARINT_ID_BYTES = 10  # a block id in a repeated uint64 field: its longest varint
SEQUENCE_BLOCK_BYTES = 3 * ID_BYTES  # one cache_sequence_blocks entry
CHUNK_OVERHEAD_BYTES = 64  # a PrefillChunk's tag and length, request id, start position, is_last, field headers
UNBOUNDED = 1 << 62
FRAMING_BYTES = 1024  # what no cost counts: the step id, the message's field headers, the trace context


def _varint_bytes(value: int) -> int:
    return max(1, (max(value, 0).bit_length() + 6) // 7)


def framing_margin(limit: int) -> int:
    """Bytes of the limit kept back for what the costs leave out: a KiB (the trace context, the step id, the
    message's field headers) and a sixteenth of the limit for anything that grows with the step."""
    return FRAMING_BYTES + limit // 16


@dataclass(frozen=True)
class StepSize:
    """What one step message may hold (`max_bytes`, the limit less the margin) and what its parts cost, from the
    worker's Info: `token_bytes` per token id (the vocabulary's longest varint), `mask_bytes` per grammar mask (id
    and words), `kv_block_size` tokens a block; `plan_*`: the routing plan's per-step and per-token bytes (0
    without a static routing table). `limit_source` names the setting that sets the limit, for refusals."""

    limit: int = UNBOUNDED
    token_bytes: int = 5
    mask_bytes: int = 0
    kv_block_size: int = 1
    plan_fixed_bytes: int = 0
    plan_token_bytes: int = 0
    limit_source: str = ""

    @classmethod
    def of(cls, worker_limit: int, router_limit: int, vocab_size: int, kv_block_size: int, planner=None) -> StepSize:
        """`worker_limit`: the worker's reported receive limit (0, an older worker: the default it runs with);
        `router_limit`: the router's own channel limit, which also bounds what it sends."""
        worker_limit = worker_limit or WORKER_MAX_MESSAGE_BYTES
        source = f"the worker's --max-message-bytes ({worker_limit} bytes)"
        if router_limit < worker_limit:
            source = f"the router's --worker-max-message-bytes ({router_limit} bytes)"
        fixed = token = 0
        if planner is not None:  # offsets int32 [rows, experts + 1] once, token_indices int32 [rows, k] a token
            rows = len(planner.table.moe_layers)
            fixed = rows * (planner.table.num_experts + 1) * 4 + rows * VARINT_ID_BYTES
            token = rows * planner.table.top_k * 4
        return cls(
            limit=min(worker_limit, router_limit),
            token_bytes=_varint_bytes(vocab_size - 1),
            mask_bytes=ID_BYTES + -(-vocab_size // 32) * 4,
            kv_block_size=kv_block_size,
            plan_fixed_bytes=fixed,
            plan_token_bytes=token,
            limit_source=source,
        )

    @property
    def max_bytes(self) -> int:
        return self.limit - framing_margin(self.limit) if self.limit < UNBOUNDED else UNBOUNDED

    def room(self, reserved: int) -> StepRoom:
        """The budget of a step being built, less `reserved` bytes already promised (frees, evictions, late masks)
        and the routing plan's fixed part; its late masks are promised out of the next message's whole budget."""
        return StepRoom(self.max_bytes - reserved - self.plan_fixed_bytes, self.max_bytes)

    def decode_bytes(self, req) -> int:
        """A decode of `req` about to be scheduled, in this message: its grammar mask only when its input token is
        back (`late_mask_bytes` otherwise)."""
        mask = self.mask_bytes if req.constrained and not req.num_pending_outputs else 0
        return ID_BYTES + self.plan_token_bytes + mask

    def late_mask_bytes(self, req) -> int:
        """What a decode of `req` about to be scheduled adds to the next message: the mask of a constrained decode
        sent with its input token pending (late masks), which goes there once that token is back."""
        return self.mask_bytes if req.constrained and req.num_pending_outputs else 0

    def chunk_bytes(self, req, start: int, n: int, first: bool, prefix_blocks: int) -> int:
        """Bytes of `req`'s chunk of `n` prompt tokens from `start`: its tokens and their plan rows, an id per
        block it completes, and on a first chunk its sampling settings, cached-block ids and (a repetition
        penalty) their tokens; the grammar mask when it ends the prompt of a constrained request."""
        cost = CHUNK_OVERHEAD_BYTES + n * (self.token_bytes + self.plan_token_bytes)
        cost += (n // self.kv_block_size + 1) * VARINT_ID_BYTES
        if first:
            cost += req.sampling_bytes + prefix_blocks * VARINT_ID_BYTES
            if req.sends_prefix_tokens:
                cost += prefix_blocks * self.kv_block_size * self.token_bytes
        if req.constrained and start + n == req.num_prompt_tokens:
            cost += self.mask_bytes
        return cost

    def tokens_that_fit(self, req, start: int, first: bool, prefix_blocks: int, max_tokens: int, room: int) -> int:
        """The longest chunk of `req` from `start`, at most `max_tokens`, whose bytes fit `room` (0: not one)."""
        n = min(req.num_prompt_tokens - start, max_tokens)
        if self.chunk_bytes(req, start, n, first, prefix_blocks) <= room:
            return n
        low, high = 0, n  # chunk_bytes grows with n: the largest n that fits, by bisection
        while low < high:
            mid = (low + high + 1) // 2
            if self.chunk_bytes(req, start, mid, first, prefix_blocks) <= room:
                low = mid
            else:
                high = mid - 1
        return low

    def prefix_blocks_that_fit(self, req, hits: int) -> int:
        """How many of its `hits` cached blocks `req` may start on: as many as let its first chunk (one token)
        fit an otherwise empty step. A repetition penalty sends the blocks' tokens; past that, the rest of the
        prefix is computed again rather than the request refused."""
        spare = self.max_bytes - self.plan_fixed_bytes - self._smallest_first_chunk(req)
        per_block = VARINT_ID_BYTES + (self.kv_block_size * self.token_bytes if req.sends_prefix_tokens else 0)
        return max(0, min(hits, spare // per_block))

    def _smallest_first_chunk(self, req) -> int:
        """A first chunk of one token on no cached block, counted as the prompt's last (its grammar mask included):
        the least any request's first step carries, whatever the token budget leaves."""
        return self.chunk_bytes(req, req.num_prompt_tokens - 1, 1, True, 0)

    def problem(self, req) -> tuple[str, str] | None:
        """(field, message) when `req`'s smallest first step (one prompt token, no cached block) cannot fit a step
        message on its own; None when it can."""
        need = self._smallest_first_chunk(req)
        if need <= self.max_bytes - self.plan_fixed_bytes:
            return None
        mask = self.mask_bytes if req.constrained else 0
        plan = self.plan_fixed_bytes + self.plan_token_bytes  # its fixed part and its token's rows
        parts = [
            ("parameters.constraint", mask, f"its grammar mask ({mask} bytes a step)"),
            ("parameters", req.sampling_bytes, f"its sampling settings ({req.sampling_bytes} bytes)"),
            ("routing_table", plan, f"the routing plan ({plan} bytes a step)"),
        ]
        # The part to blame is one without which the step would fit; when none would do, the limit leaves no room
        # for any request's first step (a limit near the margin), and the refusal says so.
        over = need + self.plan_fixed_bytes - self.max_bytes
        field, _, what = max(parts, key=lambda part: part[1])
        what += " cannot"
        if max(part[1] for part in parts) < over:
            field, what = "parameters", "not even the smallest request can"
        return field, (
            f"{what} fit a step message to the worker: its first step needs {need + self.plan_fixed_bytes} "
            f"bytes, over {self.max_bytes} (the limit, {self.limit_source}, less a {framing_margin(self.limit)}-byte "
            f"margin for framing)"
        )


class StepRoom:
    """The bytes left in the step being built (`left`), and in the next message for the late masks this step's
    decodes promise it (`late_left`): that message reserves them before anything else, so they must fit it alone."""

    def __init__(self, left: int, late_left: int = 0):
        self.left, self.late_left = left, late_left

    def take(self, num_bytes: int, late_bytes: int = 0) -> bool:
        """Spends `num_bytes` of this step and `late_bytes` of the next message when both fit; False (nothing
        spent) when either does not."""
        if num_bytes > self.left or late_bytes > self.late_left:
            return False
        self.left -= num_bytes
        self.late_left -= late_bytes
        return True
