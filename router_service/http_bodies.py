"""The HTTP front's budget of request-body bytes held at once (`http_max_body_bytes_in_flight`;
router_service/http_api.py and http_guard.read_body apply it).

A body is read whole into memory before it is parsed, so without a budget the front could hold
http_max_connections × max_message_bytes at once (16 GiB by default) under a flood of large bodies. Each request
reserves bytes before it reads: its Content-Length up front (before its 100 Continue), and, when the length is not
known in advance (chunked, compressed), more as its bytes arrive. A request whose reservation does not fit is
refused with a 503 (`too_many_body_bytes`, Retry-After) and no more of its body is read. The reservation is
released once the body is parsed (its raw bytes and JSON tree are dropped then; the request it became counts
against max_concurrent_requests), and on every way out: an error answer, a cancellation, a client gone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import TracebackType

from router_service.openai_errors import ApiError

CODE = "too_many_body_bytes"


class BodyBudget:
    """`limit` bytes of request bodies across all connections; `held` is what is reserved now."""

    def __init__(self, limit: int, retry_after_s: float, on_refused: Callable[[], None] = lambda: None):
        self.limit, self.on_refused = limit, on_refused
        self.retry_after = str(max(1, math.ceil(retry_after_s)))
        self.held = 0

    def reservation(self) -> Reservation:
        """A reservation of nothing yet, released when its `with` block ends."""
        return Reservation(self)

    def refusal(self) -> ApiError:
        message = (
            f"the router holds {self.limit} bytes of request bodies at once (http_max_body_bytes_in_flight) "
            "and this body does not fit now; retry shortly"
        )
        return ApiError(503, message, "server_error", code=CODE, headers={"Retry-After": self.retry_after})


class Reservation:
    """One request's share of the budget: grows to the bytes its body needs, released once."""

    def __init__(self, budget: BodyBudget):
        self.budget = budget
        self.bytes = 0

    def grow_to(self, size: int) -> None:
        """Holds `size` bytes in all (no less than now); raises the 503 ApiError when the budget lacks the room."""
        extra = size - self.bytes
        if extra <= 0:
            return
        budget = self.budget
        if budget.held + extra > budget.limit:
            budget.on_refused()
            raise budget.refusal()
        budget.held += extra
        self.bytes = size

    def release(self) -> None:
        self.budget.held -= self.bytes
        self.bytes = 0

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()
