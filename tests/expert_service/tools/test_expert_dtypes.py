"""The expert dtype file's parser (expert_service/tools/expert_dtypes.py) on a model deep enough for layer numbers
that YAML reads otherwise than they are written; the CLI's cases are in test_convert_quant.py."""

from __future__ import annotations

import re

import pytest

from common import quant
from common.errors import ConfigError
from common.models import config_from_hf
from expert_service.tools.expert_dtypes import load_plan
from expert_service.tools.tiny_model import tiny_hf_config

CONFIG = config_from_hf({**tiny_hf_config("mixtral"), "num_hidden_layers": 24})


@pytest.mark.parametrize("key, number", [("010", 8), ("011", 9), ("0x10", 16), ("1_0", 10), ("00", 0)])
def test_a_yaml_layer_number_not_written_in_plain_decimal_is_refused(tmp_path, key, number):
    """YAML 1.1 reads a zero-padded 010 as octal 8 (JSON's "010" is layer 10): the zero-padded layer numbers
    of an aligned file chose other layers than written, silently."""
    path = tmp_path / "plan.yaml"
    path.write_text(f"layers:\n  {key}: int8\n")
    message = rf"^{re.escape(str(path))}: key {key} \(line 2, column 3\) is the YAML number {number}; write it in plain"
    with pytest.raises(ConfigError, match=message):
        load_plan(CONFIG, None, quant.BLOCK128, path)


def test_plain_and_quoted_yaml_layer_numbers_are_read_as_written(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("layers:\n  0: int8\n  10: fp8\n  '011': bf16\n")
    plan = load_plan(CONFIG, None, quant.BLOCK128, path)
    assert {layer: plan.chosen[layer, 0].dtype for layer in (0, 10, 11)} == {
        0: "int8",
        10: "float8_e4m3fn",
        11: "bfloat16",
    }
    assert (8, 0) not in plan.chosen and (9, 0) not in plan.chosen


@pytest.mark.parametrize("value", ['""', "", "' '", "7"])
def test_an_empty_keep_hot_routing_table_is_refused_naming_the_key(tmp_path, value):
    """An empty value resolved to the plan file's own directory and was reported as "routing table not found"
    (and a bare `routing_table:` was read as the file "None")."""
    path = tmp_path / "plan.yaml"
    path.write_text(f"keep_hot:\n  routing_table: {value}\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: keep_hot.routing_table must name a routing"):
        load_plan(CONFIG, None, quant.BLOCK128, path)


def test_keep_hot_counts_only_a_gated_tables_real_predictions(tmp_path):
    """A gated table (router-gen --min-share) fills a row's end with NO_EXPERT (65535): never an expert to keep
    hot, however often it appears (np.bincount of the raw entries gave 65,536 counts and picked nothing real)."""
    import numpy as np

    from common.routing_table import NO_EXPERT, write_routing_table

    L, V, E = len(CONFIG.moe_layers), CONFIG.vocab_size, CONFIG.num_experts
    table = np.full((L, V, 2), NO_EXPERT, np.uint16)
    table[:, :, 0] = np.arange(L)[:, None] % E  # each layer's one predicted expert: layer % E
    table[:, :7, 1] = (np.arange(L)[:, None] + 1) % E  # a second prediction for a few tokens
    write_routing_table(tmp_path / "gated.bin", table, E, "sha256:" + "ab" * 32)
    path = tmp_path / "plan.yaml"
    path.write_text("keep_hot:\n  routing_table: gated.bin\n  per_layer: 1\n")
    plan = load_plan(CONFIG, None, quant.BLOCK128, path)
    assert plan.hot == {(layer, index % E) for index, layer in enumerate(CONFIG.moe_layers)}


@pytest.mark.parametrize(
    "text", ["[" * 10_000 + "]" * 10_000, "layers:\n" + "".join(f"{'  ' * i}a{i}:\n" for i in range(1, 200))]
)
def test_yaml_nested_past_pythons_stack_is_one_line(tmp_path, text):
    """PyYAML composes one level per recursive call: 10,000 '[' raised RecursionError, a traceback from `colibri
    convert`, where the JSON reader refuses nesting deeper than 64 levels in one line."""
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    with pytest.raises(
        ConfigError,
        match=rf"^{re.escape(str(path))}: not valid YAML \(nested deeper than 64 levels \(line \d+, column \d+\)\)$",
    ):
        load_plan(CONFIG, None, None, path)


def test_keep_hot_keeps_no_expert_that_no_row_names(tmp_path):
    """A gated table whose layer names fewer experts than per_layer filled the rest with experts no token predicts
    (ties at a count of 0 went to the lowest ids): experts 0, 1, ... kept dense because nothing named them. Only
    the experts some row names are hot."""
    import numpy as np

    from common.routing_table import NO_EXPERT, write_routing_table

    L, V, E = len(CONFIG.moe_layers), CONFIG.vocab_size, CONFIG.num_experts
    table = np.full((L, V, 2), NO_EXPERT, np.uint16)
    table[:, :5, 0] = E - 1  # a few tokens predict the last expert, at every layer; nothing else is predicted
    table[0] = NO_EXPERT  # the first MoE layer predicts nothing at all
    write_routing_table(tmp_path / "gated.bin", table, E, "sha256:" + "ab" * 32)
    path = tmp_path / "plan.yaml"
    path.write_text("keep_hot:\n  routing_table: gated.bin\n  per_layer: 3\n")
    plan = load_plan(CONFIG, None, quant.BLOCK128, path)
    assert plan.hot == {(layer, E - 1) for layer in CONFIG.moe_layers[1:]}


def test_a_yaml_explicit_key_is_read_as_written(tmp_path):
    """The loader's key hook was named check_key, which is also the YAML scanner's test for a '?' key indicator:
    any '?' starting a token raised a TypeError, a traceback where a one-line error or a plan was due."""
    path = tmp_path / "plan.yaml"
    path.write_text("layers:\n  ? 10\n  : int8\nexperts: {? '3.1' : fp8}\n")
    plan = load_plan(CONFIG, None, quant.BLOCK128, path)
    assert plan.chosen[10, 0].dtype == "int8" and plan.chosen[3, 1].dtype == "float8_e4m3fn"


@pytest.mark.parametrize(
    "text, message",
    [
        ("default: ?int8\n", "default: expert dtype '?int8' is not supported"),
        ("default: ?\n", "not valid YAML (mapping keys are not allowed here)"),
        ("layers: {? 010 : int8}\n", "key 010 (line 1, column 12) is the YAML number 8"),
    ],
)
def test_a_question_mark_in_yaml_is_a_one_line_error(tmp_path, text, message):
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: {re.escape(message)}"):
        load_plan(CONFIG, None, quant.BLOCK128, path)


def test_two_yaml_merges_naming_one_layer_are_refused(tmp_path):
    """Two '<<' keys in one mapping kept the first merge's dtype for layer 3 and dropped the second's silently."""
    path = tmp_path / "plan.yaml"
    path.write_text("layers:\n  <<: {3: int8}\n  <<: {3: fp8}\n")
    message = f"{path}: duplicate key '<<' (line 3, column 3)"
    with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
        load_plan(CONFIG, None, quant.BLOCK128, path)


@pytest.mark.parametrize("name", ["plan.yaml", "plan.json"])
def test_a_fifo_as_the_expert_dtype_file_is_named_as_one(tmp_path, name):
    """A FIFO (or device) there was reported as 'expert dtype file not found', though something was there."""
    import os

    path = tmp_path / name
    os.mkfifo(path)
    with pytest.raises(
        ConfigError, match="^" + re.escape(f"--expert-dtype-file: {path}: not a regular file (a FIFO)") + "$"
    ):
        load_plan(CONFIG, None, quant.BLOCK128, path)
