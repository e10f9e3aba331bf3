"""A FIFO at a model directory's tokenizer.json, at routing_table.bin or at the --config file was read as missing
(a model served without text, no routing table) or blocked its reader in open() until a writer came, for ever; each
is now refused in one line naming the file and saying what is there."""

from __future__ import annotations

import os
import secrets
import shutil

import pytest

from common.config import load_config_file
from common.errors import ConfigError, ModelFormatError
from common.model_format import ModelDir
from common.routing_table import RoutingTable, recorded_model_digest
from expert_service.engine.config import EngineConfig
from expert_service.experts.routing_plan import worker_plan_table
from expert_service.tools.model_tokenizer import read_tokenizer
from router_service.tokenizer import Tokenizer
from tests.helpers import outcome_unblocked

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def model(tiny_model, tmp_path):
    """A copy of the tiny model whose tokenizer.json and routing_table.bin are FIFOs."""
    copy = tmp_path / f"model-{secrets.token_hex(3)}"
    copy.mkdir()
    for p in tiny_model.iterdir():
        if p.name not in ("tokenizer.json", "routing_table.bin") and p.is_file():
            shutil.copyfile(p, copy / p.name)
    os.mkfifo(copy / "tokenizer.json")
    os.mkfifo(copy / "routing_table.bin")
    return copy


def _refused(result, kind, path):
    assert isinstance(result, kind), result
    assert str(path) in str(result) and "a FIFO" in str(result) and "\n" not in str(result), result


def test_a_fifo_at_tokenizer_json_is_refused_not_read_as_missing(model):
    path = model / "tokenizer.json"
    _refused(outcome_unblocked(lambda: read_tokenizer(ModelDir.open(model, verify=False))), ModelFormatError, path)
    _refused(outcome_unblocked(lambda: Tokenizer.from_model_dir(model)), ConfigError, path)


def test_a_fifo_at_routing_table_bin_is_refused_not_read_as_missing(model, caplog):
    path = model / "routing_table.bin"
    config = ModelDir.open(model, verify=False).config
    for read in (RoutingTable.load, RoutingTable.check):
        _refused(outcome_unblocked(lambda read=read: read(path, config, None)), ModelFormatError, path)
    # the worker passes over its model directory's table when it does not fit, saying why (not "no table")
    plan = outcome_unblocked(
        lambda: worker_plan_table(ModelDir.open(model, verify=False), EngineConfig(prefetch="plan"))
    )
    assert plan is None and any(str(path) in r.message and "a FIFO" in r.message for r in caplog.records)
    named = EngineConfig(prefetch="plan", plan_table=str(path))
    _refused(
        outcome_unblocked(lambda: worker_plan_table(ModelDir.open(model, verify=False), named)), ModelFormatError, path
    )
    assert outcome_unblocked(lambda: recorded_model_digest(path)) is None


def test_a_fifo_at_the_config_file_is_refused_saying_so(tmp_path):
    path = tmp_path / f"colibri-{secrets.token_hex(3)}.yaml"
    os.mkfifo(path)
    _refused(outcome_unblocked(lambda: load_config_file(path, "router")), ConfigError, path)
