"""The step contract between the worker's engine and a compute backend.

The engine turns the router's step (prompt chunks and decodes) into a ``ForwardBatch``; a ``Decoder`` runs it
and returns ``Logits``: the rows the sampler reads, wherever they live. Greedy sequences need only the argmax
(and a finiteness check), which the cuda backend computes on the device; full rows cross to the host only
when a sequence samples or asks for logprobs. A ``StepTrace`` collects what the pass observed (exact routing,
expert-cache counts). Both backends are built the same way: ``Decoder(model, config, slot_plan)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from common.routing_table import RoutingTable
from expert_service.engine.config import Backend
from expert_service.engine.penalties import PenaltyBatch
from expert_service.engine.sampling import SamplingParams
from expert_service.engine.token_masks import apply_mask, masked_allowed
from expert_service.experts.cache import CacheStats
from expert_service.experts.slots import SlotPlan


@dataclass(frozen=True, slots=True)
class PrefillInput:
    request_id: int
    token_ids: np.ndarray  # prompt tokens of this chunk
    sampling: SamplingParams | None  # set on a sequence's first chunk
    is_last: bool  # the chunk ends the prompt: sample the first new token
    # Prefix caching (the router's block ids, owned by the caller's stream): on a first chunk, the cached blocks
    # the sequence starts with; then one id per block this chunk completes (0: not cached), registered after it.
    prefix_block_ids: tuple[int, ...] = ()
    cache_block_ids: tuple[int, ...] = ()
    prefix_token_ids: tuple[int, ...] = ()  # a penalised sequence's cached prefix tokens (the penalty counts them)
    # The sequence's tokens before this chunk, as the router counts them (0 on a later chunk: not given, unchecked).
    # Past the engine's count, an earlier chunk never ran (refused with its step): this one then fails alone.
    start_position: int = 0


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """One step's tokens: sequence s owns rows seq_starts[s]:seq_starts[s+1] of every [T, ...] array."""

    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64, position of each token in its sequence
    seq_starts: np.ndarray  # [S + 1] int64
    context_lens: np.ndarray  # [S] tokens of each sequence in the cache after this step
    block_tables: list[np.ndarray]  # S x [blocks] int64
    slot_mapping: np.ndarray  # [T] flat pool slot (block * block_size + row) of each token
    logits_rows: np.ndarray  # rows whose logits are wanted (e.g. each sequence's last token)
    routed_experts: dict[int, np.ndarray] | None = None  # routing=lut: layer -> planned expert ids [T, k]
    expert_hints: dict[int, np.ndarray] | None = None  # the router's plan (either routing): layer -> [T, k],
    # what the expert cache prefetches from (-1: no prediction, a token the table predicts fewer experts for)
    penalties: PenaltyBatch | None = None  # penalty state updates and the penalised sampling rows (the first
    # rows of logits_rows); None: no penalised sequence in the step
    fed_rows: np.ndarray | None = None  # [T] int32: the logits row of the step launched just before whose
    # argmax is this token (a decode whose input is still on the
    # device), or -1 (token_ids holds it); None: all -1
    token_masks: np.ndarray | None = None  # [R, W] uint32: grammar masks of the first R logits rows (the sampling
    # rows; engine/token_masks.py), all ones for an unconstrained row; None: no constrained sequence in the step
    masks_late: bool = False  # some rows' masks come after launch (Decoder.complete): the masks, the masked
    # argmax and the readback wait for them


@dataclass
class StepTrace:
    """What a forward pass observed, for routing-plan recall and expert statistics."""

    expert_ids: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [T, K]
    expert_cache: CacheStats | None = None  # this step's expert-cache counts (None: all experts resident)


class Logits(Protocol):
    """A step's logits rows [R, V] in output order, on the host or the device. Read the rows before the
    decoder's next step: the cuda backend's live in a workspace that step overwrites (``greedy`` stays valid)."""

    def greedy(self, row: int) -> tuple[int, bool]:
        """(argmax, every value finite) of one row, after the step's penalties."""

    def __getitem__(self, row: int) -> np.ndarray:
        """One row as float32 [V] on the host: the model's raw logits."""

    def processed(self, row: int) -> np.ndarray:
        """One row after the step's penalties and token mask (the raw row where none apply), float32 [V] on the
        host."""

    def allowed(self, row: int) -> np.ndarray | None:
        """bool [V]: the tokens the row's grammar mask allows (None: unconstrained); log-probabilities of a
        constrained row are of this distribution."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[np.ndarray]: ...


class HostLogits:
    """Logits already on the host: [rows, V] float32, the penalised copy of the first rows (None: none) and the
    token masks of the first rows (None: none; applied to the processed rows as they are read)."""

    def __init__(self, logits: np.ndarray, penalized: np.ndarray | None = None, masks: np.ndarray | None = None):
        self.array, self.penalized, self.masks = logits, penalized, masks
        self._masked: dict[int, np.ndarray] = {}

    def greedy(self, row: int) -> tuple[int, bool]:
        """(argmax, all finite) of one row, after the step's penalties."""
        return int(np.argmax(self.processed(row))), bool(np.all(np.isfinite(self._penalized(row))))

    def __getitem__(self, row: int) -> np.ndarray:
        return self.array[row]

    def _penalized(self, row: int) -> np.ndarray:
        return self.penalized[row] if self.penalized is not None and row < len(self.penalized) else self.array[row]

    def processed(self, row: int) -> np.ndarray:
        values = self._penalized(row)
        if self.masks is None or row >= len(self.masks):
            return values
        if row not in self._masked:
            self._masked[row] = apply_mask(values, self.masks[row])
        return self._masked[row]

    def allowed(self, row: int) -> np.ndarray | None:
        return masked_allowed(self.masks, row, self.array.shape[1])

    def __len__(self) -> int:
        return self.array.shape[0]

    def __iter__(self):
        return iter(self.array)


class Decoder(Protocol):
    """A compute backend: weights, the KV pool and the forward pass. Constructed as
    ``Decoder(model: ModelDir, config: EngineConfig, slot_plan: SlotPlan)``."""

    backend: Backend
    slot_plan: SlotPlan  # how its experts are held (all resident, or a cache of slots)
    # the routing table its expert cache's plan prefetch looks each step's tokens up in (None: the router's plans,
    # or no cache): the engine measures that prediction's recall against the exact routing
    plan_lookup: RoutingTable | None

    @property
    def router_plan_width(self) -> int:
        """The predictions a token of the router's plans its prefetch reads (0: every one): Info.plan_width."""

    @property
    def supports_overlap(self) -> bool:
        """A step may be launched before the one ahead of it is finished (its greedy rows feed the later
        step's decodes: batch.fed_rows). Read-only here: the cuda backend derives it from its config."""

    def forward(self, batch: ForwardBatch, trace: StepTrace | None = None) -> Logits:
        """Runs the step, writing its K/V into the pool; logits of ``batch.logits_rows``."""

    def launch(self, batch: ForwardBatch, traced: bool = False):
        """Starts the step (``forward`` = ``finish(launch(batch))``); returns a handle for ready/finish. traced:
        finish will be given a StepTrace to fill."""

    def complete(self, launched, masks: np.ndarray):
        """A step launched with ``batch.masks_late``: queues its full masks [R, W] (the masked argmax replaces
        the greedy ids before a later step reads them) and its readback; returns the handle to finish. Called
        before the next launch."""

    def ready(self, launched) -> bool:
        """Whether ``finish`` would return without waiting."""

    def blocks_host(self, num_tokens: int) -> bool:
        """Whether launching a step of this many tokens waits for the device inside the pass."""

    def abandon(self) -> None:
        """Forgets launched steps that will never be finished (after a fault)."""

    def finish(self, launched, trace: StepTrace | None = None) -> Logits:
        """Waits for a launched step; its logits. Steps are finished in launch order."""

    def memory_plan(self) -> list[tuple[str, int]]:
        """(what, bytes) of everything allocated at start-up."""

    def warmup(self) -> None:
        """Start-up work that must not happen while serving (compiling kernels, capturing graphs)."""

    def close(self) -> None:
        """Releases the backend's resources (device memory, pinned host ranges, threads)."""
