"""Building a static routing table from exact routing over a corpus (`colibri router-gen`).

The corpus token stream is cut into sequences of `sequence_length`; the last `holdout` fraction of them is
kept aside. Every other sequence is prefilled with the engine (exact routing), and for each MoE layer we
count how often each (token id, expert) pair is chosen. The table keeps, per layer and token id, the k most
frequent experts; ties, and token ids never seen, are ranked by the fallback: the layer's gate applied to
the token's embedding normalised by the norm that feeds the gate (post_attn_norm), i.e. the routing the
token would get if attention and earlier layers added nothing to the residual stream. With --min-share F, only
the predictions whose share of the token's occurrences is >= F are kept, NO_EXPERT after them
(expert_service/tools/routing_shares.py). Recall, and the predictions a token keeps and their precision, are then
measured against exact routing of the held-out sequences.

Memory: counting buffers one int32 key (token * E + expert; int64 when V * E >= 2**31) per chosen expert,
i.e. 4 * L * K bytes per training token (L MoE layers, K = num_experts_per_tok), compacted with np.unique
into (key, count) pairs whenever the buffer passes 64 Mi keys, so the bound is min(4 * L * K * tokens,
12 bytes * distinct pairs + 256 MiB). Held-out routing is kept as uint16: 2 * L * K bytes per held-out
token. Building the table needs one dense [V, E] int64 count array per layer at a time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from common import dtypes
from common.errors import ConfigError, InvalidRequestError, ModelFormatError
from common.files import write_new
from common.model_format import ModelDir
from common.routing_table import NO_EXPERT, model_digest, write_routing_table
from expert_service.cpu.layers.moe import route
from expert_service.cpu.layers.norm import rms_norm
from expert_service.engine.engine import Engine, PrefillInput
from expert_service.engine.sampling import SamplingParams
from expert_service.tools.model_tokenizer import read_tokenizer
from expert_service.tools.routing_shares import TableCounts, gate_by_share, write_counts

CORPUS_FORMATS = ("auto", "text", "ids")
_COMPACT_KEYS = 64 * 1024 * 1024
_VOCAB_BATCH = 4096
_IDS_PATTERN = re.compile(rb"[\s,0-9]*")
_ID_WORD = re.compile(rb"[+-]?[0-9]+")
NO_CORPUS_NOTE = (
    "no corpus given: the table is the embedding fallback only (gate applied to each token's "
    "normalised embedding); recall not measured (pass --corpus to build from traffic and measure it)"
)


# --- corpus -------------------------------------------------------------------------------------------
def load_corpus(path: str | Path, corpus_format: str, model: ModelDir) -> np.ndarray:
    """The corpus as token ids int64 [N]: a text file tokenised with the model's tokenizer, or integers."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"--corpus: {path} is a directory (name the corpus file)")
    if not path.is_file():  # a FIFO or device (--corpus /dev/stdin) is there, but cannot be read twice or sized
        what = "is not a regular file (a corpus is read from a file)" if path.exists() else "not found"
        raise ConfigError(f"--corpus: {path} {what}")
    data = path.read_bytes()
    if not data.strip():  # before the tokenizer is looked for: an empty file is no text either
        raise ConfigError(f"--corpus: {path} holds no tokens")
    if corpus_format == "auto":
        corpus_format = "ids" if _IDS_PATTERN.fullmatch(data[: 1 << 16]) and data.strip() else "text"
    ids = _parse_ids(data, path, model.config.vocab_size) if corpus_format == "ids" else _tokenize(data, path, model)
    if ids.size == 0:
        raise ConfigError(f"--corpus: {path} holds no tokens")
    vocab = model.config.vocab_size
    bad = np.flatnonzero((ids < 0) | (ids >= vocab))
    if bad.size:
        raise InvalidRequestError(
            "--corpus", f"{path}: token {bad[0]} is id {ids[bad[0]]}, expected < vocab_size={vocab}"
        )
    return ids


def _parse_ids(data: bytes, path: Path, vocab_size: int) -> np.ndarray:
    words = data.replace(b",", b" ").split()
    # Decimal integers only: int() alone also reads b"1_0" as 10, and a word it refuses may still look like one
    # to a looser test (b"--5" had no culprit to name: a StopIteration traceback).
    bad = next((w for w in words if not _ID_WORD.fullmatch(w)), None)
    if bad is not None:
        raise InvalidRequestError(
            "--corpus", f"{path}: expected integers separated by whitespace or commas, found {bad[:40]!r}"
        )
    ids = [int(w) for w in words]
    try:
        return np.array(ids, dtype=np.int64)
    except OverflowError:  # past int64: named here as load_corpus names any other id outside the vocabulary
        big = next(i for i, v in enumerate(ids) if not -(2**63) <= v < 2**63)
        raise InvalidRequestError(
            "--corpus", f"{path}: token {big} is id {ids[big]}, expected < vocab_size={vocab_size}"
        ) from None


def _tokenize(data: bytes, path: Path, model: ModelDir) -> np.ndarray:
    tokenizer = read_tokenizer(model)
    if tokenizer is None:
        raise ModelFormatError(
            f"{model.path / 'tokenizer.json'}: not found; a text corpus needs the model's "
            f"tokenizer (or pass token ids with --corpus-format ids)"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--corpus: {path} is not UTF-8 text ({e}); token ids need --corpus-format ids") from None
    # Encode ~1 MiB runs of whole lines in a batch, so a large corpus never becomes one giant encoding.
    lines, size = text.splitlines(keepends=True), 0
    chunks: list[list[str]] = []
    for line in lines:
        if not chunks or size > (1 << 20):
            chunks.append([])
            size = 0
        chunks[-1].append(line)
        size += len(line)
    encodings = tokenizer.encode_batch(["".join(c) for c in chunks], add_special_tokens=False)
    return np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encodings] or [np.zeros(0, np.int64)])


def split_sequences(ids: np.ndarray, sequence_length: int, holdout: float) -> tuple[list, list]:
    """Cuts `ids` into sequences (the last may be shorter); the last `holdout` share (>= 1 if there are
    >= 2 sequences and holdout > 0) is held out. Returns (train, heldout) lists of int64 arrays."""
    sequences = [ids[i : i + sequence_length] for i in range(0, ids.size, sequence_length)]
    num_held = 0
    if holdout > 0 and len(sequences) >= 2:
        num_held = min(len(sequences) - 1, max(1, round(holdout * len(sequences))))
    return sequences[: len(sequences) - num_held], sequences[len(sequences) - num_held :]


# --- exact routing --------------------------------------------------------------------------------------
def trace_routing(engine: Engine, sequences: list[np.ndarray], progress: bool = False, desc: str = "trace"):
    """Yields (token_ids [T], {model layer: expert ids [T, K]}) per engine step, packing as many whole
    sequences into a step as the engine allows. Each sequence is prefilled alone (no context carried)."""
    max_tokens, max_seqs = engine.config.max_batch_tokens, engine.config.max_batch_size
    with tqdm(total=len(sequences), desc=desc, unit="seq", disable=not progress) as bar:
        start = 0
        while start < len(sequences):
            end, tokens = start, 0
            while end < len(sequences) and end - start < max_seqs and tokens + len(sequences[end]) <= max_tokens:
                tokens += len(sequences[end])
                end += 1
            batch = [
                PrefillInput(rid, seq, SamplingParams(), False)  # is_last False: no sampling needed
                for rid, seq in enumerate(sequences[start:end])
            ]
            try:
                result = engine.step(batch)
            finally:
                engine.release([p.request_id for p in batch])
            yield np.concatenate(sequences[start:end]), result.trace.expert_ids
            bar.update(end - start)
            start = end


class RoutingCounts:
    """Per MoE layer, how often each (token id, expert) pair was chosen: raw int32 keys (token * E + expert)
    are buffered, then merged into sorted unique keys with counts once the buffer is large."""

    def __init__(self, vocab_size: int, num_experts: int, num_layers: int):
        self.vocab_size, self.num_experts, self.num_layers = vocab_size, num_experts, num_layers
        self.key_dtype = np.int32 if vocab_size * num_experts < 2**31 else np.int64
        self.buffer: list[list[np.ndarray]] = [[] for _ in range(num_layers)]  # per layer: raw keys
        self.merged = [(np.zeros(0, self.key_dtype), np.zeros(0, np.int64)) for _ in range(num_layers)]
        self.buffered = 0
        self.occurrences = np.zeros(vocab_size, dtype=np.int64)  # [V]: each token id's occurrences in training

    def add(self, token_ids: np.ndarray, experts_per_layer: list[np.ndarray]) -> None:
        """token_ids [T]; experts_per_layer: per MoE layer, chosen expert ids [T, K]."""
        self.occurrences += np.bincount(token_ids, minlength=self.vocab_size)
        base = token_ids.astype(self.key_dtype)[:, None] * self.num_experts
        for layer, experts in enumerate(experts_per_layer):
            self.buffer[layer].append((base + experts.astype(self.key_dtype)).ravel())
            self.buffered += experts.size
        if self.buffered > _COMPACT_KEYS:
            for layer in range(self.num_layers):
                self._compact(layer)
            self.buffered = 0

    def _compact(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        if self.buffer[layer]:
            new_keys, new_counts = np.unique(np.concatenate(self.buffer[layer]), return_counts=True)
            keys, inverse = np.unique(np.concatenate([self.merged[layer][0], new_keys]), return_inverse=True)
            weights = np.concatenate([self.merged[layer][1], new_counts])
            self.merged[layer] = (
                keys,
                np.bincount(inverse.ravel(), weights=weights, minlength=keys.size).astype(np.int64),
            )
            self.buffer[layer] = []
        return self.merged[layer]

    def dense(self, layer: int) -> np.ndarray:
        """Counts [V, E] int64 of one MoE layer."""
        keys, counts = self._compact(layer)
        out = np.zeros(self.vocab_size * self.num_experts, dtype=np.int64)
        out[keys] = counts
        return out.reshape(self.vocab_size, self.num_experts)


# --- the table ------------------------------------------------------------------------------------------
def fallback_ranking(model: ModelDir, layer: int, token_start: int, token_end: int) -> np.ndarray:
    """Experts [b, E] of tokens token_start..token_end-1 at model layer `layer`, best first (ties: lower id),
    by the gate on the token's embedding normalised with the layer's post_attn_norm (which feeds the gate)."""
    config = model.config
    rows = model.tensor("embed_tokens")[token_start:token_end]  # widen only these rows (a 152k vocab is GBs)
    embed = dtypes.to_float32(rows, model.entries["embed_tokens"].dtype).astype(np.float32, copy=False)
    x = rms_norm(embed, model.tensor_f32(f"layers.{layer}.post_attn_norm"), config.rms_norm_eps)
    ranking, _ = route(x @ model.tensor_f32(f"layers.{layer}.router").T, config.num_experts, False)
    return ranking


def build_table(model: ModelDir, counts: RoutingCounts | None, top_k: int) -> np.ndarray:
    """uint16 [L, V, top_k]: per MoE layer and token, the top_k most counted experts, ties and unseen tokens
    ranked by `fallback_ranking` (so with no counts the table is the fallback alone)."""
    return ranked_table(model, counts, top_k)[0]


def ranked_table(model: ModelDir, counts: RoutingCounts | None, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(`build_table`'s table, the count of each of its entries int64 [L, V, top_k]: zeros without counts)."""
    config = model.config
    V = config.vocab_size
    table = np.zeros((len(config.moe_layers), V, top_k), dtype=np.uint16)
    chosen = np.zeros(table.shape, dtype=np.int64)
    for l, layer in enumerate(config.moe_layers):
        dense = counts.dense(l) if counts is not None else None
        for lo in range(0, V, _VOCAB_BATCH):
            hi = min(V, lo + _VOCAB_BATCH)
            ranking = fallback_ranking(model, layer, lo, hi)  # [b, E]
            if dense is not None:
                # Stable sort by count over the fallback order = lexicographic (count, fallback rank).
                by_count = np.argsort(-np.take_along_axis(dense[lo:hi], ranking, axis=1), axis=1, kind="stable")
                ranking = np.take_along_axis(ranking, by_count, axis=1)
                chosen[l, lo:hi] = np.take_along_axis(dense[lo:hi], ranking[:, :top_k], axis=1)
            table[l, lo:hi] = ranking[:, :top_k]
    return table, chosen


def score_sums(table: np.ndarray, token_ids: np.ndarray, experts_per_layer: list[np.ndarray]) -> np.ndarray:
    """Per MoE layer, sums over tokens of |table(token) ∩ exact(token)| / |exact(token)| (recall), of
    |table(token) ∩ exact(token)| (hits) and of the predictions table(token) makes: float64 [L, 3] (a NO_EXPERT
    entry is no prediction and matches nothing)."""
    sums = np.zeros((len(experts_per_layer), 3), dtype=np.float64)
    for l, exact in enumerate(experts_per_layer):
        predicted = table[l, token_ids]  # [T, k]
        hits = int((exact[:, :, None] == predicted[:, None, :]).any(axis=2).sum())
        sums[l] = hits / exact.shape[1], hits, int((predicted != NO_EXPERT).sum())
    return sums


def recall_sums(table: np.ndarray, token_ids: np.ndarray, experts_per_layer: list[np.ndarray]) -> np.ndarray:
    """Per MoE layer, the sum over tokens of |table(token) ∩ exact(token)| / |exact(token)|."""
    return score_sums(table, token_ids, experts_per_layer)[:, 0]


def generate(
    model: ModelDir,
    engine: Engine | None,
    corpus: np.ndarray | None,
    top_k: int,
    holdout: float,
    sequence_length: int,
    progress: bool = False,
    min_share: float = 0.0,
) -> tuple[np.ndarray, dict, TableCounts | None]:
    """(table uint16 [L, V, top_k], report dict, the table's counts: None without a corpus). `engine` is only
    needed with a corpus. min_share > 0 needs a corpus: without one no token has a share, and every prediction
    would go."""
    config = model.config
    moe_layers = config.moe_layers
    report: dict[str, Any] = {  # the JSON report written next to the table
        "top_k": top_k,
        "model_top_k": config.num_experts_per_tok,
        "num_experts": config.num_experts,
        "vocab_size": config.vocab_size,
        "moe_layers": moe_layers,
        "min_share": min_share,
        "has_corpus": corpus is not None,
        "corpus_tokens": 0,
        "sequence_length": sequence_length,
        "train_sequences": 0,
        "heldout_sequences": 0,
        "train_tokens": 0,
        "heldout_tokens": 0,
        "heldout_unseen_share": None,
        "recall_per_layer": None,
        "recall": None,
        "predictions_per_token_per_layer": None,
        "predictions_per_token": None,
        "precision_per_layer": None,
        "precision": None,
        "fallback_recall_per_layer": None,
        "fallback_recall": None,
        "note": NO_CORPUS_NOTE,
    }
    if corpus is None:
        if min_share > 0:
            raise ConfigError("--min-share: needs --corpus (a token's share is counted over the corpus)")
        return build_table(model, None, top_k), report, None
    assert engine is not None, "a corpus needs an engine to trace its routing"
    train, heldout = split_sequences(corpus, sequence_length, holdout)
    counts = RoutingCounts(config.vocab_size, config.num_experts, len(moe_layers))
    for token_ids, traced in trace_routing(engine, train, progress, "trace train"):
        counts.add(token_ids, [traced[layer] for layer in moe_layers])
    ranked, chosen = ranked_table(model, counts, top_k)
    table = gate_by_share(ranked, chosen, counts.occurrences, min_share)
    counted = TableCounts(np.where(table == NO_EXPERT, 0, chosen), counts.occurrences)
    gated = f"; predictions kept where their share is >= {min_share}, unseen token ids predict nothing"
    report.update(
        corpus_tokens=int(corpus.size),
        train_sequences=len(train),
        heldout_sequences=len(heldout),
        train_tokens=int(sum(s.size for s in train)),
        heldout_tokens=int(sum(s.size for s in heldout)),
        note="table from exact routing over the corpus"
        + (gated if min_share > 0 else "; unseen token ids use the embedding fallback"),
    )
    if not heldout:
        report["note"] += "; nothing held out (corpus shorter than two sequences or --holdout 0): recall not measured"
        return table, report, counted
    # The fallback alone is scored too: it shows what the corpus added.
    fallback = build_table(model, None, top_k)
    sums, fallback_sums, unseen = np.zeros((len(moe_layers), 3)), np.zeros((len(moe_layers), 3)), 0
    for token_ids, traced in trace_routing(engine, heldout, progress, "trace held-out"):
        exact = [traced[layer] for layer in moe_layers]
        sums += score_sums(table, token_ids, exact)
        fallback_sums += score_sums(fallback, token_ids, exact)
        unseen += int((counts.occurrences[token_ids] == 0).sum())  # not a [V] mask rebuilt per sequence
    tokens = report["heldout_tokens"]
    per_layer, fallback_per_layer, predictions = sums[:, 0] / tokens, fallback_sums[:, 0] / tokens, sums[:, 2] / tokens
    precision = [float(h / p) if p else None for h, p in zip(sums[:, 1], sums[:, 2])]
    report.update(
        recall_per_layer=[float(r) for r in per_layer],
        recall=float(per_layer.mean()),
        predictions_per_token_per_layer=[float(p) for p in predictions],
        predictions_per_token=float(predictions.mean()),
        precision_per_layer=precision,
        precision=float(sums[:, 1].sum() / sums[:, 2].sum()) if sums[:, 2].sum() else None,
        fallback_recall_per_layer=[float(r) for r in fallback_per_layer],
        fallback_recall=float(fallback_per_layer.mean()),
        heldout_unseen_share=unseen / tokens,
    )
    return table, report, counted


def report_path_for(out: Path) -> Path:
    return out.with_name(out.name + ".report.json")


def run_router_gen(
    model: ModelDir,
    engine_factory,
    corpus: np.ndarray | None,
    corpus_path: str | None,
    out: Path,
    top_k: int,
    holdout: float,
    sequence_length: int,
    progress: bool = False,
    min_share: float = 0.0,
    save_counts: bool = False,
) -> dict:
    """Builds and writes the table and `<out>.report.json` (and with `save_counts` `<out>.counts.npz`); returns
    the report."""
    if save_counts and corpus is None:
        raise ConfigError("--save-counts: needs --corpus (a table from the fallback alone counted nothing)")
    engine = engine_factory() if corpus is not None else None
    table, report, counted = generate(model, engine, corpus, top_k, holdout, sequence_length, progress, min_share)
    write_routing_table(out, table, model.config.num_experts, model_digest(model.path))
    counts_file = None
    if save_counts and counted is not None:
        counts_file = str(write_counts(out, table, counted.counts, counted.occurrences, min_share))
    report = {"model": str(model.path), "table": str(out), "corpus": corpus_path, "counts": counts_file, **report}
    write_new(report_path_for(out), (json.dumps(report, indent=1) + "\n").encode())  # a link there is replaced
    return report
