"""Arguments and set-up shared by the offline subcommands (`logits`, `complete`): no services involved."""

from __future__ import annotations

import argparse

import numpy as np

from common.config import add_flags, flag_values, resolve
from common.errors import ConfigError, InvalidRequestError
from common.model_format import ModelDir
from common.token_ids import parse_id_list
from expert_service.backends import build_engine
from expert_service.engine.config import EngineConfig, RoutingMode
from expert_service.engine.engine import Engine
from expert_service.tools.cli.paths import given_path


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="Colibri model directory")
    parser.add_argument("--tokens", required=True, metavar="IDS", help="prompt token ids, comma-separated")
    add_flags(parser, EngineConfig)


def parse_token_ids(text: str, vocab_size: int) -> np.ndarray:
    try:
        # Split on commas only: spaces inside an item ("1 2") are an error, not digits to join into one id (12).
        ids = parse_id_list(text)
    except ValueError as e:
        raise InvalidRequestError("--tokens", str(e)) from None
    if not ids:
        raise InvalidRequestError("--tokens", "the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError("--tokens", f"token id {bad[0]} is outside [0, {vocab_size})")
    return np.asarray(ids, dtype=np.int64)


def open_engine(args: argparse.Namespace) -> tuple[Engine, np.ndarray]:
    given_path(args.model, "--model", "the model directory")
    config = resolve(EngineConfig, flags=flag_values(args, EngineConfig))
    if config.routing is RoutingMode.LUT:  # the engine would refuse the first step, after loading the model
        raise ConfigError(
            "routing: lut takes the routing plan the router sends with each step, and the offline subcommands have "
            "no router (use --routing exact, or serve with `colibri serve --routing lut --routing-table FILE`)"
        )
    model = ModelDir.open(args.model, verify=config.verify_checksums)
    ids = parse_token_ids(args.tokens, model.config.vocab_size)
    # Checked here so the message names the flag (the engine's names its internal sequence id) and comes before
    # the engine is built.
    if ids.size > model.config.max_position_embeddings:
        raise InvalidRequestError(
            "--tokens", f"{ids.size} tokens exceed max_position_embeddings {model.config.max_position_embeddings}"
        )
    return build_engine(model, config), ids
