"""bench/offload.py on a trained model: prompts from text, the table `colibri router-gen` built, and the
Hugging Face checkpoint the model was converted from as the reference.

With `--model DIR` (a converted Colibri model directory) the benchmark runs that model instead of the random
reference shapes, and with `--prompts FILE` every prefill chunk and decode context is a slice of FILE's text,
tokenised with DIR/tokenizer.json without special tokens (as router-gen tokenises its corpus), at an offset
drawn from a seeded generator, instead of uniform random ids. Random ids through a trained model route like
no real traffic; a held-out text (one the model and the table never saw) routes like the traffic the table
is meant for. `--table` (default DIR/routing_table.bin) is the table the plan prefetch looks up, and its
`.report.json`, when present, is recorded beside the runs. `--hf-model` is the checkpoint that DIR was
converted from, for the transformers + accelerate reference at the same device budget.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from common.errors import ConfigError
from common.model_format import ModelDir
from common.model_manifest import MANIFEST
from common.routing_table import RoutingTable, model_digest
from expert_service.tools.routing_gen import load_corpus, report_path_for

# What offload.json keeps of router-gen's report (the rest is paths and sizes already recorded).
REPORT_KEYS = (
    "top_k",
    "num_experts",
    "corpus",
    "train_tokens",
    "heldout_tokens",
    "heldout_unseen_share",
    "recall_per_layer",
    "recall",
    "min_share",
    "predictions_per_token",
    "precision",
    "fallback_recall_per_layer",
    "fallback_recall",
    "note",
)


class TokenSource:
    """Prompt token ids: uniform random ids in [0, vocab_size), or slices of a token stream at random offsets.
    `sampler()` restarts the seeded generator, so every run (fraction x prefetch mode) gets the same prompts."""

    def __init__(self, vocab_size: int, stream: np.ndarray | None = None, path: Path | None = None, seed: int = 0):
        self.vocab_size, self.stream, self.path, self.seed = vocab_size, stream, path, seed

    def sampler(self):
        """take(n) -> int64 [n]: the next prompt of n tokens."""
        rng = np.random.default_rng(self.seed)
        if self.stream is None:
            return lambda n: rng.integers(0, self.vocab_size, n)

        def take(n: int) -> np.ndarray:
            if n > self.stream.size:
                raise ConfigError(f"--prompts: {self.path} holds {self.stream.size} tokens, a prompt needs {n}")
            start = int(rng.integers(0, self.stream.size - n + 1))
            return self.stream[start : start + n].copy()

        return take

    def describe(self) -> dict:
        if self.stream is None:
            return {"kind": "random ids", "vocab_size": self.vocab_size, "seed": self.seed}
        return {"kind": "text slices", "file": str(self.path), "tokens": int(self.stream.size), "seed": self.seed}


def text_source(model: ModelDir, path: str | Path, longest_prompt: int) -> TokenSource:
    """The text at `path` tokenised by the model's tokenizer; one-line errors when it cannot give a prompt."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--prompts: {path} not found")
    stream = load_corpus(path, "text", model)  # ConfigError / ModelFormatError name the file
    if stream.size < longest_prompt:
        raise ConfigError(f"--prompts: {path} holds {stream.size} tokens, the longest prompt needs {longest_prompt}")
    return TokenSource(model.config.vocab_size, stream, path)


def open_model(path: str | Path, flag: str = "--model") -> ModelDir:
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise ConfigError(
            f"{flag}: {path} is not a Colibri model directory (no {MANIFEST}; `colibri convert` writes one)"
        )
    return ModelDir.open(path, verify=False)


def load_table(model: ModelDir, path: str | Path) -> tuple[RoutingTable, dict]:
    """The router-gen table at `path`, checked against the model, and what its report says about it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"--table: {path} not found (build it with `colibri router-gen {model.path} --corpus "
            f"FILE`, or leave plan out of --prefetch-modes)"
        )
    # RoutingTableError: one line naming the header field (or the model digest of a table built for another model)
    table = RoutingTable.load(path, model.config, model_digest(model.path))
    cfg = model.config
    summary = {
        "table": str(path),
        "source": "colibri router-gen",
        "top_k": table.top_k,
        "complete": table.complete,  # false: a gated table (router-gen --min-share), some entries NO_EXPERT
        "num_experts": cfg.num_experts,
        "chance_recall": cfg.num_experts_per_tok / cfg.num_experts,
    }
    report_path = report_path_for(path)
    if report_path.is_file():
        report = json.loads(report_path.read_text())
        summary.update({k: report[k] for k in REPORT_KEYS if k in report})
    return table, summary


def load_hf(hf_dir: str | Path):
    """The checkpoint in bfloat16 on the host (the reference waits there while Colibri has the GPU)."""
    import torch
    import transformers

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise ConfigError(
            f"--hf-model: {hf_dir} has no config.json (expected the checkpoint --model was converted from)"
        )
    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
