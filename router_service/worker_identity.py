"""Whether a worker serves the model this router was started for.

The router tokenizes, renders chat templates and applies generation defaults from its own model directory, and
builds its constraint compiler for the vocabulary and end tokens of the first worker it accepted; a worker
restarted with another model would take those ids and answer with another model's tokens. `ModelCheck.problem`
compares a worker's Info with what those depend on: the router's own model directory (the digest of its
tokenizer.json's vocabulary, the manifest's family and HF config) when it has one and the worker reports its
digests, and always the first worker the router accepted (family, vocabulary, end tokens, context length, HF
config, tokenizer digest). A digest a worker leaves empty (one that predates them) is not compared. The weights
are not compared (the manifest's digest, which Info reports, changes with any conversion): another conversion of
the same model (8-bit experts, say) or a fine-tune on the same architecture and tokenizer is served, since nothing
the router holds depends on them; neither are a worker's limits (KV pool, batch caps), backend, routing or served
name, which may change between connections."""

from __future__ import annotations

import json
import math
from pathlib import Path

from common.model_identity import MANIFEST, TOKENIZER, vocabulary_digest

_SHORT = 60  # characters of a value a refusal quotes
# HF config keys that record where a checkpoint came from or how its weights are stored, not the model the router
# serves: a fine-tune (another _name_or_path, transformers_version) or a conversion from the FP8 release of the same
# model (quantization_config, torch_dtype) differs in them alone, and the weights are not compared.
_PROVENANCE = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype", "quantization_config"})


def _config(text: str) -> dict | None:
    try:
        value = json.loads(text) if text else None
    except (ValueError, RecursionError):  # unreadable, or nested past Python's stack: not compared
        return None
    return value if isinstance(value, dict) else None


def worker_fields(info) -> dict[str, object]:
    """What identifies the model a worker serves, by the name a refusal gives each (absent: not reported)."""
    fields: dict[str, object] = {
        "family": info.family,
        "vocab_size": info.vocab_size,
        "eos_token_ids": list(info.eos_token_ids),
        "max_position_embeddings": info.max_position_embeddings,
    }
    if (config := _config(info.hf_config_json)) is not None:
        fields["config"] = config
    if info.tokenizer_digest:
        fields["tokenizer.json vocabulary digest"] = info.tokenizer_digest
    return fields


def dir_fields(model_dir: str) -> dict[str, object]:
    """The same fields as far as the router's own model directory holds them ({} without one): colibri.json read
    once for its family and HF config (not hashed: the weights are not compared), the tokenizer's digest."""
    root = Path(model_dir)
    fields: dict[str, object] = {}
    try:
        manifest = json.loads((root / MANIFEST).read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError, RecursionError):
        manifest = None
    if isinstance(manifest, dict) and isinstance(manifest.get("config"), dict):
        fields["family"], fields["config"] = manifest.get("family"), manifest["config"]
    if tokenizer := vocabulary_digest(root / TOKENIZER):
        fields["tokenizer.json vocabulary digest"] = tokenizer
    return fields


def _show(value: object) -> str:
    text = value.removeprefix("sha256:")[:12] if isinstance(value, str) and value.startswith("sha256:") else None
    text = text or json.dumps(value, sort_keys=True)
    return text if len(text) <= _SHORT else text[: _SHORT - 3] + "..."


def same(a: object, b: object) -> bool:
    """Whether two JSON values are equal, NaN equal to NaN: json.loads reads a config's NaN as a float that equals
    nothing, itself included, and the worker's would never match. Iterative: a deep value cannot exhaust the stack."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if isinstance(x, dict) and isinstance(y, dict):
            if x.keys() != y.keys():
                return False
            stack.extend((x[key], y[key]) for key in x)
        elif isinstance(x, list) and isinstance(y, list):
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y))
        elif not (x == y or (_is_nan(x) and _is_nan(y))):
            return False
    return True


def _is_nan(value: object) -> bool:
    return isinstance(value, float) and math.isnan(value)


def first_difference(worker: dict[str, object], reference: dict[str, object]) -> tuple[str, object, object] | None:
    """(name, the worker's value, the reference's) of the first field both hold that differs; an HF config is
    compared key by key, so the name is the first config key that differs ("config.json num_hidden_layers"),
    its provenance keys (_PROVENANCE) left out."""
    for name in (name for name in worker if name in reference):
        mine, theirs = worker[name], reference[name]
        if name == "config" and isinstance(mine, dict) and isinstance(theirs, dict):
            for key in sorted((mine.keys() | theirs.keys()) - _PROVENANCE):
                if not same(mine.get(key), theirs.get(key)):
                    return f"config.json {key}", mine.get(key), theirs.get(key)
        elif not same(mine, theirs):
            return name, mine, theirs
    return None


_ORDER = ("family", "vocab_size", "eos_token_ids", "max_position_embeddings", "config")


def _ordered(fields: dict[str, object]) -> dict[str, object]:
    """Named fields first (a refusal names the plainest difference), digests last."""
    return {k: fields[k] for k in sorted(fields, key=lambda k: (_ORDER.index(k) if k in _ORDER else len(_ORDER), k))}


class ModelCheck:
    """The model this router serves: its model directory's (read once, at start) and the first accepted worker's."""

    def __init__(self, model_dir: str = ""):
        self.model_dir = model_dir
        self.own = dir_fields(model_dir) if model_dir else {}
        self.accepted: dict[str, object] | None = None

    def problem(self, info) -> str | None:
        """None when the worker serves this router's model; else one line naming the first field that differs."""
        worker = _ordered(worker_fields(info))
        # the directory's family and config only against a worker that reports its digests: one that predates
        # them (or a test's fake) is held to the first worker's model alone
        own = self.own if info.model_digest else {}
        for reference, whose in (
            (own, f"the router's model directory {self.model_dir} has"),
            (self.accepted or {}, "the first worker the router accepted served"),
        ):
            if (difference := first_difference(worker, reference)) is not None:
                name, mine, theirs = difference
                return f"it serves another model: {name} {_show(mine)}, where {whose} {_show(theirs)}"
        return None

    def accept(self, info) -> None:
        """Pins the first worker accepted (and fields a later one reports first, such as the digests of a worker
        upgraded since); every later one must serve the same model."""
        self.accepted = {**worker_fields(info), **(self.accepted or {})}
