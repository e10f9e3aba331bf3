"""What the router derives from a worker's InfoResponse when it (re)connects: the scheduler's limits, the
validation limits, a prefix index of its own for that connection (a restarted worker holds no cached block), and
whether the constraint compiler built for an earlier connection still fits (worker_identity.py refuses a worker
of another model before any of this)."""

from __future__ import annotations

import logging

from router_service.config import RouterConfig, step_timeouts_problem
from router_service.constraints import ConstraintCompiler
from router_service.generation_defaults import GenerationDefaults
from router_service.prefix_cache import PrefixCache
from router_service.routing import RoutingPlanner
from router_service.scheduler import SchedulerLimits
from router_service.step_size import StepSize
from router_service.validation import ModelLimits, ValidatedRequest

log = logging.getLogger("colibri.router.worker_info")


def scheduler_limits(config: RouterConfig, info) -> SchedulerLimits:
    """The router's batch limits, capped by the worker's (0 there: no cap), and the worker's KV pool."""
    return SchedulerLimits(
        max_batch_size=min(config.max_batch_size, info.max_batch_size or config.max_batch_size),
        max_batch_tokens=min(config.max_batch_tokens, info.max_batch_tokens or config.max_batch_tokens),
        kv_block_size=info.kv_block_size,
        num_kv_blocks=info.num_kv_blocks,
    )


def step_size(config: RouterConfig, info, planner=None) -> StepSize:
    """The byte budget of a step message: the worker's receive limit (0 from a worker that predates the field: its
    64 MiB default), within the router's own channel limit."""
    return StepSize.of(
        info.max_message_bytes, config.worker_max_message_bytes, info.vocab_size, info.kv_block_size, planner
    )


def step_timeout_problem(config: RouterConfig, info) -> str | None:
    """step_timeouts_problem (router_service.config) of this router's step deadline and the watchdog the worker
    reports; None also from a worker that predates InfoResponse.step_timeout_s."""
    if not info.step_timeout_s:
        return None
    return step_timeouts_problem(config.worker_step_timeout_s, info.step_timeout_s)


def plan_gaps_problem(config: RouterConfig, info, planner: RoutingPlanner | None) -> str | None:
    """Why the worker would refuse every step this router plans (None: it would not): a table with NO_EXPERT entries
    gives some tokens fewer than k experts, and workers that predate InfoResponse.plans_with_gaps need exactly k."""
    if planner is None or planner.table.complete or info.plans_with_gaps:
        return None
    return (
        f"routing_table {config.routing_table} has NO_EXPERT entries (`router-gen --min-share`), so its plans list "
        "fewer than k experts for some tokens, which this worker refuses (no InfoResponse.plans_with_gaps): upgrade "
        "the worker, or start the router with a table built without --min-share"
    )


def planner_for(planner: RoutingPlanner | None, info) -> RoutingPlanner | None:
    """The planner whose plans this worker reads whole: a worker reporting InfoResponse.plan_width (its prefetch
    stages that many predictions a token of a router's plan) gets each token's first plan_width, the table's best
    ranks, instead of dropping what it has no room for; 0 (every one, or a worker before the field): as it is."""
    if planner is None:
        return None
    narrowed = planner.narrowed(info.plan_width)
    if narrowed is planner:
        return planner
    log.info(
        "routing plans: the worker's prefetch reads %d predictions a token; this router's table has %d, so each "
        "token's plan sends its first %d (give the worker the table itself, --plan-table, to prefetch them all)",
        info.plan_width,
        planner.table.top_k,
        info.plan_width,
    )
    return narrowed


def model_limits(info, defaults: GenerationDefaults, has_tokenizer: bool) -> ModelLimits:
    """The request validation's view of the model: the worker's end tokens first, then generation_config.json's
    that fall inside its vocabulary."""
    eos = tuple(dict.fromkeys([*info.eos_token_ids, *(i for i in defaults.eos_token_ids if i < info.vocab_size)]))
    return ModelLimits(
        vocab_size=info.vocab_size,
        max_sequence_length=info.max_position_embeddings,
        kv_capacity_tokens=info.kv_block_size * info.num_kv_blocks,
        eos_token_ids=eos,
        has_tokenizer=has_tokenizer,
        generation=defaults,
    )


def prefix_index(config: RouterConfig, info) -> PrefixCache | None:
    """A fresh index for this worker connection, or None when caching is off or the worker cannot follow it.
    Hashes cover what changes a block's KV: the model."""
    if not config.prefix_caching or not info.prefix_caching:
        return None
    identity = "\0".join([info.model_name, info.family, info.dtype, info.routing, info.hf_config_json])
    return PrefixCache(info.kv_block_size, identity.encode(), info.caches_generated_blocks)


def sends_prefix_tokens(request: ValidatedRequest, info) -> bool:
    """Whether the request's cached prefix tokens go to the worker (with its first chunk): a repetition penalty
    counts them; presence and frequency count output tokens only, but workers that predate
    InfoResponse.prefix_tokens_for_repetition_only refuse any penalised sequence on cached blocks without them."""
    if request.repetition_penalty != 1.0:
        return True
    return request.penalized and not info.prefix_tokens_for_repetition_only


def kept_compiler(compiler: ConstraintCompiler | None, limits: ModelLimits) -> ConstraintCompiler | None:
    """The constraint compiler while the worker's vocabulary (its masks' width) and end tokens are the ones it was
    built for; None when they changed, so the next constrained request builds one for this worker."""
    if compiler is None or (compiler.vocab_size, compiler.eos_token_ids) != (limits.vocab_size, limits.eos_token_ids):
        return None
    return compiler
