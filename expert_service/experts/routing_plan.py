"""Routing plans on the worker (docs/routing.md; the type is `common.routing_plan.RoutingPlan`): the router's
per-layer prediction of which experts each of the step's tokens goes to. With `routing=lut` the plan is the
routing (combine weights = softmax of the gate logits of just the planned experts); with `routing=exact` it is
a prediction whose recall is measured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

from common.errors import ConfigError, ModelFormatError
from common.model_config import ModelConfig
from common.model_format import ModelDir
from common.routing_plan import RoutingPlan
from common.routing_table import NO_EXPERT, TABLE_FILE, RoutingTable
from expert_service.engine.config import EngineConfig, PrefetchSource, RoutingMode

log = logging.getLogger("colibri.worker")
T = TypeVar("T")
ROUTER_PLANS = "router"  # EngineConfig.plan_table: the router's plans, never a table on the device


def routing_plan_recall(planned: dict[int, np.ndarray], exact: dict[int, np.ndarray]) -> float | None:
    """Share of the exact (token, expert) assignments the routing plan predicted, over all planned MoE layers
    (both as {layer: expert ids [T, k]}; a planned -1, no prediction, matches none)."""
    hits = total = 0
    for layer, exact_ids in exact.items():
        predicted = planned.get(layer)
        if predicted is None:
            continue
        hits += int((exact_ids[:, :, None] == predicted[:, None, :]).any(axis=-1).sum())
        total += exact_ids.size
    return hits / total if total else None


def table_recall(table: RoutingTable, token_ids: np.ndarray, exact: dict[int, np.ndarray]) -> float | None:
    """`routing_plan_recall` of the table's own prediction for a step's input tokens [T] (the worker's plan
    lookup), every MoE layer of `exact` ({layer: ids [T, K]}) at once (a NO_EXPERT entry matches no expert)."""
    if not exact or not len(token_ids):
        return None
    predicted = table.lookup(token_ids)[[table.moe_layers.index(layer) for layer in exact]]  # [L, T, k]
    ids = np.stack(list(exact.values()))  # [L, T, K]
    return int((ids[:, :, :, None] == predicted[:, :, None, :]).any(axis=-1).sum()) / ids.size


def lookup_hints(table: RoutingTable, token_ids: np.ndarray) -> dict[int, np.ndarray]:
    """The plan prefetch's predictions for a step's tokens [T] from the table: {MoE layer: expert ids [T, k]
    int32}, -1 where the table predicts nothing (NO_EXPERT), as the device's lookup (kernels/table_hints.py) and
    the router's padded plans write it."""
    ids = table.lookup(token_ids).astype(np.int32)
    ids[ids == NO_EXPERT] = -1
    return dict(zip(table.moe_layers, ids))


def warmup_routing_plan(moe_layers: list[int], num_experts: int, top_k: int, num_tokens: int) -> RoutingPlan:
    """A routing plan sending every token to experts 0..top_k-1 (the worker's own warm-up step under
    routing=lut)."""
    expert_ids = np.broadcast_to(np.arange(top_k, dtype=np.int32), (len(moe_layers), num_tokens, top_k))
    return RoutingPlan.from_expert_ids(moe_layers, expert_ids, num_experts)


def worker_plan_table(model: ModelDir, config: EngineConfig) -> RoutingTable | None:
    """The routing table the expert cache's plan prefetch looks each step's own tokens up in (on the device on
    the cuda backend; EngineConfig.plan_table), or None: the prefetch reads the router's plans (or is off).
    Under routing=lut the router's plan is the routing itself, so its plans are what the prefetch reads. The
    model directory's own table is taken when it fits the model, else passed over with a warning; a file named
    in plan_table must fit (one-line error otherwise). Logs which source the prefetch reads."""
    if PrefetchSource.PLAN not in config.prefetch_sources:
        return None
    table, why = _plan_table(model, config)
    if table is None:
        log.info("plan prefetch: the router's plans (%s)", why)
    else:
        log.info(
            "plan prefetch: %s (%d experts a token), looked up by the worker; the router's plans are not read",
            why,
            table.top_k,
        )
    return table


def check_plan_table(model: ModelDir, config: EngineConfig, cached: bool) -> None:
    """The plan_table file the settings will read, checked at start-up before the worker binds its ports (it is
    loaded with the engine, after the model's bytes are verified): a file that opens, with a header that fits the
    model and the size that header gives. One line naming the setting and the file otherwise (ConfigError for no
    such file, RoutingTableError for one that does not fit, as the load would raise). `cached`: the expert cache
    runs (the worker's slot plan), without which no table is read."""
    if config.plan_table in ("", ROUTER_PLANS):
        return
    if _unread(config, cached) is None:
        _named_table(model, config, RoutingTable.check)


def warn_unread_plan_table(config: EngineConfig, cached: bool) -> str | None:
    """A plan_table file the settings leave unread (no expert cache, no plan prefetch, or routing=lut) is named in
    a warning, not passed over in silence (nor checked); returns why it is unread, or None when it is read."""
    if config.plan_table in ("", ROUTER_PLANS):
        return None
    why = _unread(config, cached)
    if why is not None:
        log.warning("plan_table: %s is not read (%s)", config.plan_table, why)
    return why


def _unread(config: EngineConfig, cached: bool) -> str | None:
    """Why the settings leave a plan_table file unread, or None when they read it."""
    if not cached:
        return "every expert is resident: no expert cache runs (see --expert-cache-gb)"
    if PrefetchSource.PLAN not in config.prefetch_sources:
        return f"--prefetch {config.prefetch} has no plan"
    if config.routing is RoutingMode.LUT:
        return "routing=lut: the router's plan is the routing"
    return None


def _named_table(model: ModelDir, config: EngineConfig, read: Callable[[Path, ModelConfig, str | None], T]) -> T:
    """`read(path, model config, model digest)` of the file plan_table names, its errors naming the setting."""
    path = Path(config.plan_table)
    if _nothing_to_read(path):  # a FIFO there: `read` says what it is
        raise ConfigError(f"plan_table: {path} is not a file (a `colibri router-gen` table, or {ROUTER_PLANS!r})")
    try:
        return read(path, model.config, model.digest)
    except ModelFormatError as e:  # the file is named; the setting too, as the missing-file error does
        raise type(e)(f"plan_table: {e}") from None


def _nothing_to_read(path: Path) -> bool:
    """Nothing, or a directory, at `path`; anything else (a file, a link, a FIFO) is for the table reader to open
    or refuse saying what it is."""
    return not (path.exists() or path.is_symlink()) or path.is_dir()


def _plan_table(model: ModelDir, config: EngineConfig) -> tuple[RoutingTable | None, str]:
    """worker_plan_table's choice and where it comes from."""
    if config.routing is RoutingMode.LUT:
        return None, "routing=lut: the plan is the routing"
    if config.plan_table == ROUTER_PLANS:
        return None, f"plan_table={ROUTER_PLANS}"
    if config.plan_table:
        return _named_table(model, config, RoutingTable.load), str(Path(config.plan_table))
    path = model.path / TABLE_FILE
    if _nothing_to_read(path):  # a FIFO there is told below, not taken for none
        return None, f"no {TABLE_FILE} in the model directory"
    try:
        return RoutingTable.load(path, model.config, model.digest), str(path)
    except ModelFormatError as e:
        log.warning("plan prefetch: %s; passed over (--plan-table names another table)", e)
        return None, f"the model directory's {TABLE_FILE} does not fit the model"
