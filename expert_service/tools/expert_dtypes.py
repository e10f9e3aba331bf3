"""Which storage each routed expert gets at conversion: `--expert-dtype`, `--fp8-scale` and an optional
per-layer / per-expert file (JSON, or YAML when the name ends in .yaml/.yml; docs/quantization.md):

    default: int8                 # every expert not named below (default: --expert-dtype)
    fp8_scale: block128           # channel | block128, for fp8 experts (default: --fp8-scale)
    layers: {0: bfloat16, 3: fp8} # every expert of a layer
    experts: {"3.5": bfloat16}    # "layer.expert": one expert (wins over its layer)
    keep_hot:                     # keep the experts a routing table predicts most often in the dense dtype
      routing_table: routing_table.bin   # a `colibri router-gen` table of an earlier conversion of this
                                         # checkpoint (relative: to this file; never OUT_DIR's own)
      per_layer: 4                       # that many experts per MoE layer

Each rule names a dtype (bfloat16, float16, float32, int8, fp8 / float8_e4m3fn); later rules win: default,
then layers, then experts, then keep_hot. Unknown keys, layers that are not MoE layers and experts out of
range are refused, one line naming the file and the key, as are a key written twice (or two keys naming one layer
or expert), an experts key that is not a string (YAML reads an unquoted 1.10 as the number 1.1) and a YAML
number key not in plain decimal (010 is octal 8 there).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common import dtypes, quant
from common.errors import ConfigError, ModelFormatError
from common.expert_layout import ExpertFormat
from common.model_config import ModelConfig

FILE_KEYS = ("default", "fp8_scale", "layers", "experts", "keep_hot")
FP8_SCALES = {"channel": quant.CHANNEL, "block": quant.BLOCK128, "block128": quant.BLOCK128}


def fp8_scheme(name: object, where: str) -> str:
    if not isinstance(name, str) or name not in FP8_SCALES:
        raise ConfigError(f"{where}: fp8 scale {name!r} is not supported (supported: channel, block128)")
    return FP8_SCALES[name]


def expert_format(dtype: str, scheme: str) -> ExpertFormat:
    """The format of a canonical expert dtype: int8 per channel, fp8 with `scheme`, others unscaled."""
    if dtype == "int8":
        return ExpertFormat(dtype, quant.CHANNEL)
    return ExpertFormat(dtype, scheme if dtype == "float8_e4m3fn" else None)


@dataclass(frozen=True)
class ExpertPlan:
    """(layer, expert) -> how it is stored: `hot` experts in the dense dtype, else `chosen`, else `default`,
    else as the checkpoint stores it (an fp8 checkpoint's experts keep their bytes, re-scaled when an fp8 scale
    other than theirs was asked for; others: dense dtype)."""

    default: ExpertFormat | None
    chosen: dict[tuple[int, int], ExpertFormat] = field(default_factory=dict)
    hot: frozenset[tuple[int, int]] = frozenset()
    fp8_scheme: str | None = None  # the fp8 scale asked for (--fp8-scale or the file's fp8_scale); None: not asked
    hot_table: Path | None = None  # the routing table keep_hot read (convert must not remove it: it is an input)

    def resolve(self, layer: int, expert: int, dense_dtype: str, stored: ExpertFormat | None) -> ExpertFormat:
        if (layer, expert) in self.hot:
            return ExpertFormat(dense_dtype)
        fmt = self.chosen.get((layer, expert), self.default)
        if fmt is None and stored is not None and stored.dtype == "float8_e4m3fn" and self.fp8_scheme is not None:
            return expert_format(stored.dtype, self.fp8_scheme)
        return fmt or stored or ExpertFormat(dense_dtype)


def _index(key: object, limit: int, where: str, what: str) -> int:
    text = str(key)
    if not (text.isascii() and text.isdigit()) or not 0 <= int(text) < limit:  # str.isdigit alone takes '²'
        raise ConfigError(f"{where}: {what} {key!r} is not in [0, {limit})")
    return int(text)


def load_plan(
    config: ModelConfig, expert_dtype: str | None, fp8_scale: str | None, path: str | Path | None = None
) -> ExpertPlan:
    """The conversion's expert plan from the flags and, when given, the file at `path` (`fp8_scale` None: not
    asked, block128)."""
    asked = fp8_scheme(fp8_scale, "--fp8-scale") if fp8_scale is not None else None
    scheme = asked or quant.BLOCK128
    default = expert_format(dtypes.canonical_expert_dtype(expert_dtype), scheme) if expert_dtype is not None else None
    if path is None:
        return ExpertPlan(default, fp8_scheme=asked)
    if str(path) == "":  # Path("") is ".", the working directory
        raise ConfigError("--expert-dtype-file: empty; name a JSON or YAML file")
    path = Path(path)
    spec = _read(path)
    unknown = [k for k in spec if k not in FILE_KEYS]
    if unknown:
        # the file plans routed experts only: a key naming the LM head is pointed at the flag that stores it
        head = "; the LM head's storage is --head-dtype" if "head" in str(unknown[0]).lower() else ""
        raise ConfigError(f"{path}: unknown key {unknown[0]!r} (keys: {', '.join(FILE_KEYS)}{head})")
    if "fp8_scale" in spec:
        scheme = asked = fp8_scheme(spec["fp8_scale"], f"{path}: fp8_scale")

    def fmt(value: object, where: str) -> ExpertFormat:
        try:
            return expert_format(dtypes.canonical_expert_dtype(value, f"{path}: {where}"), scheme)
        except ModelFormatError as e:
            raise ConfigError(str(e)) from None

    if "default" in spec:
        default = fmt(spec["default"], "default")
    elif default is not None:  # --expert-dtype fp8 with the file's fp8_scale
        default = expert_format(default.dtype, scheme)
    chosen: dict[tuple[int, int], ExpertFormat] = {}
    moe_layers, num_experts = config.moe_layers, config.num_experts
    named_layers: set[int] = set()  # 0 and '0' (or 2 and 02) are two keys but one layer: never pick one silently
    for key, value in _mapping(spec.get("layers", {}), path, "layers").items():
        layer = _index(key, config.num_hidden_layers, f"{path}: layers", "layer")
        if layer not in moe_layers:
            raise ConfigError(f"{path}: layers: layer {layer} has no routed experts (MoE layers: {moe_layers})")
        if layer in named_layers:
            raise ConfigError(f"{path}: layers: layer {layer} is named twice")
        named_layers.add(layer)
        chosen.update({(layer, j): fmt(value, f"layers.{key}") for j in range(num_experts)})
    named_experts: set[tuple[int, int]] = set()
    for key, value in _mapping(spec.get("experts", {}), path, "experts").items():
        if not isinstance(key, str):  # YAML reads 1.10 as the number 1.1: it would name expert 1
            raise ConfigError(f"{path}: experts: key {key!r} must be a quoted string 'layer.expert'")
        layer_text, _, expert_text = key.partition(".")
        layer = _index(layer_text, config.num_hidden_layers, f"{path}: experts.{key}", "layer")
        if layer not in moe_layers:
            raise ConfigError(f"{path}: experts: layer {layer} has no routed experts (MoE layers: {moe_layers})")
        expert = _index(expert_text, num_experts, f"{path}: experts.{key}", "expert")
        if (layer, expert) in named_experts:
            raise ConfigError(f"{path}: experts: expert {expert} of layer {layer} is named twice")
        named_experts.add((layer, expert))
        chosen[layer, expert] = fmt(value, f"experts.{key}")
    hot, hot_table = _keep_hot(spec["keep_hot"], config, path) if "keep_hot" in spec else (frozenset(), None)
    return ExpertPlan(default, chosen, hot, asked, hot_table)


def _keep_hot(spec: object, config: ModelConfig, path: Path) -> tuple[frozenset[tuple[int, int]], Path]:
    """The `per_layer` experts each MoE layer's table rows name most often (over every token id; ties to
    the lower id): the experts most tokens are predicted to use; and the table's path."""
    from common.routing_table import NO_EXPERT, RoutingTable

    keep = _mapping(spec, path, "keep_hot")
    unknown = [k for k in keep if k not in ("routing_table", "per_layer")]
    if unknown or "routing_table" not in keep:
        raise ConfigError(f"{path}: keep_hot takes routing_table (required) and per_layer, got {sorted(keep)}")
    per_layer = keep.get("per_layer", 1)
    if isinstance(per_layer, bool) or not isinstance(per_layer, int) or not 0 <= per_layer <= config.num_experts:
        raise ConfigError(f"{path}: keep_hot.per_layer must be an integer in [0, {config.num_experts}]")
    name = keep["routing_table"]
    if not isinstance(name, str) or not name.strip():  # "" would be this file's own directory
        raise ConfigError(
            f"{path}: keep_hot.routing_table must name a routing table file (relative: to this file), got {name!r}"
        )
    table_path = path.parent / name
    try:
        # no digest to check: the model being converted has no colibri.json yet (the table is an earlier
        # conversion's of this checkpoint, docs/quantization.md), so the table is checked on its shape alone
        table = RoutingTable.load(table_path, config, None)
    except ModelFormatError as e:  # the table names itself; the file and key that named it are said first
        raise type(e)(f"{path}: keep_hot.routing_table: {e}") from None
    hot: set[tuple[int, int]] = set()
    for index, layer in enumerate(table.moe_layers):
        named = table.table[index].ravel()
        counts = np.bincount(named[named != NO_EXPERT], minlength=config.num_experts)  # NO_EXPERT names none
        # a gated table may name fewer than per_layer experts: one no row names is no hot expert, whatever its id
        ranked = np.argsort(-counts, kind="stable")[:per_layer]
        hot.update((layer, int(expert)) for expert in ranked if counts[expert])
    return frozenset(hot), table_path


def _mapping(value: object, path: Path, key: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: {key} must be a mapping, got {type(value).__name__}")
    return value


def _read(path: Path) -> dict:
    from common.files import read_setting_file
    from common.strict_json import parse_json

    data = read_setting_file(path, "--expert-dtype-file")  # a FIFO or device is named as such, never waited on
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        from common.unique_keys import DuplicateKeyError, UniqueKeyLoader

        class Loader(UniqueKeyLoader):
            def check_mapping_key(self, key_node, key) -> None:
                if key_node.tag == "tag:yaml.org,2002:int" and not re.fullmatch(r"0|[1-9][0-9]*", key_node.value):
                    mark = key_node.start_mark
                    raise ConfigError(  # YAML 1.1 reads 010 as octal 8, 0x10 as 16, 1_0 as 10
                        f"{path}: key {key_node.value} (line {mark.line + 1}, column {mark.column + 1}) is the "
                        f"YAML number {key}; write it in plain decimal or quote it"
                    )

        try:
            spec = yaml.load(data.decode(), Loader=Loader)
        except DuplicateKeyError as e:
            raise ConfigError(f"{path}: {e}") from None
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    else:
        spec = parse_json(data, path, ConfigError)
    return _mapping(spec, path, "the file")
