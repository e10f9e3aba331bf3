"""The cuda decoder's host side without a GPU: which bucket a step takes, what it stages (padding included), which
passes it issues and which graphs warm-up leaves captured. The device work (the model's `layers` and `head`, `_run`,
graph capture) is replaced by recorders; staging writes the real pinned-buffer layout into numpy arrays."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

import expert_service.cuda.driver as driver
from common.models import config_from_hf
from expert_service.cuda.decoder import CudaDecoder
from expert_service.cuda.driver import GraphCache
from expert_service.cuda.staging import prefill_buckets
from expert_service.cuda.workspace import (
    HOST_TWINS,
    METADATA,
    RESULTS,
    SHARE_METADATA,
    Workspace,
    layout_workspace,
    packed_layout,
)
from expert_service.engine.config import EngineConfig
from expert_service.engine.cuda_options import CudaOptions
from expert_service.engine.step import ForwardBatch
from expert_service.tools.tiny_model import tiny_hf_config

MAX_TOKENS, MAX_SEQS, BLOCK, MAX_BLOCKS = 512, 16, 8, 64


class FakeGraph:
    captured: list = []

    def __init__(self, stream):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def replay(self):
        FakeGraph.captured.append("replay")

    def close(self):
        pass


class HostBuffer:
    """PackedBuffer's host side: twins of views at the packed offsets; uploads are recorded, not copied."""

    def __init__(self, shapes):
        self.offsets, total = packed_layout(shapes)
        self.twins = [np.full(total, -99, np.int32) for _ in range(HOST_TWINS)]
        self.twin_views = [
            {n: host[o : o + int(np.prod(s))].reshape(s) for (n, s), o in zip(shapes.items(), self.offsets.values())}
            for host in self.twins
        ]
        self.uploads = []
        self.select(0)

    def select(self, twin):
        self.host, self.views = self.twins[twin], self.twin_views[twin]
        self.host_views = self.views

    def end_of(self, name, elements):
        return self.offsets[name] + elements

    def upload(self, elements, handle, start=0):
        self.uploads.append((start, elements))

    def download(self, elements, handle):
        pass


class DeviceRows:
    """A device array view for the all-rows path's copies."""

    def __init__(self, rows):
        self.rows = rows

    def __getitem__(self, key):
        return self

    def copy_to_device(self, host, stream=None):
        pass

    def copy_to_host(self, host, stream=None):
        host[:] = self.rows[: len(host)]


def host_decoder(
    monkeypatch,
    family="mixtral",
    cuda_graphs=True,
    bf16=False,
    options: CudaOptions | None = None,
    shared_members: int = 0,
) -> CudaDecoder:
    monkeypatch.setattr(driver, "Graph", FakeGraph)
    FakeGraph.captured = []
    cfg = config_from_hf(tiny_hf_config(family))
    d = CudaDecoder.__new__(CudaDecoder)
    d.config, d.cached, d.planned_routing = cfg, None, False
    d.engine_config = EngineConfig(
        backend="cuda",
        cuda_graphs=cuda_graphs,
        max_batch_tokens=MAX_TOKENS,
        max_batch_size=MAX_SEQS,
        kv_block_size=BLOCK,
        kv_cache_tokens=4096,
    )
    d.max_tokens, d.max_seqs, d.seq_slots = MAX_TOKENS, MAX_SEQS, MAX_SEQS + 1
    d.block_size, d.max_blocks_per_seq, d.moe_layers = BLOCK, MAX_BLOCKS, cfg.moe_layers
    d.workspace_shared_members = shared_members  # 0: laid out without shared prefixes
    d.weights = SimpleNamespace(dtype=np.dtype(np.uint16 if bf16 else np.float32), quantized=False, all_8bit=False)
    layout = layout_workspace(
        cfg, d.weights.dtype, MAX_TOKENS, MAX_SEQS, MAX_BLOCKS, len(cfg.moe_layers), shared_members=shared_members
    )
    shared = SHARE_METADATA if shared_members else ()
    metadata = HostBuffer({n: layout[n][0] for n in METADATA[:-1] + shared + METADATA[-1:]})
    results = HostBuffer({n: layout[n][0] for n in RESULTS})
    logits = np.random.default_rng(0).standard_normal((MAX_SEQS, cfg.vocab_size)).astype(np.float32)
    d.ws = SimpleNamespace(
        metadata=metadata,
        results=results,
        host={**metadata.views, **results.views, "logits": np.zeros_like(logits)},
        logits_rows=DeviceRows(None),
        logits=DeviceRows(logits),
    )
    d.ws.select_twin = lambda twin: Workspace.select_twin(d.ws, twin)
    d.stream, d._stream_handle, d.staged_steps = SimpleNamespace(synchronize=lambda: None), None, 0
    d._twin, d._done = (
        0,
        [SimpleNamespace(record=lambda handle: None, wait=lambda: None, ready=lambda: True) for _ in range(HOST_TWINS)],
    )
    d._unfinished = set()
    d.penalties = SimpleNamespace(warmup=lambda logits: None, logits=None)
    d.token_masks = SimpleNamespace(warmup=lambda logits, penalized: None)
    d.graphs, d.prefill_graphs, d.head_graphs = GraphCache(d.stream), GraphCache(d.stream), GraphCache(d.stream)
    d.issued = []
    d.model = SimpleNamespace(
        options=options or CudaOptions(),
        layers=lambda T, S, decode, shared=False: d.issued.append(("layers", T, S, decode) + ("shared",) * shared),
        head=lambda T, R: d.issued.append(("head", T, R)),
        moe=SimpleNamespace(warm_cublas_shapes=lambda T: d.issued.append(("cublas shapes", T))),
        head_8bit=None,  # a dense head and dense attention projections
        attention_8bit=None,
    )
    d.workspace_strategies = d.strategies.reachable(d.model.options, d.cached is not None)
    return d


def prompt(lengths, cached=(), logits=True) -> ForwardBatch:
    """Sequences with `lengths` new tokens after `cached` ones (0 by default); each samples when `logits`."""
    cached = list(cached) or [0] * len(lengths)
    ends = np.cumsum(lengths)
    T = int(ends[-1])
    return ForwardBatch(
        token_ids=np.arange(3, 3 + T),
        positions=np.concatenate([np.arange(c, c + n) for c, n in zip(cached, lengths)]),
        seq_starts=np.concatenate([[0], ends]),
        context_lens=np.array(cached) + lengths,
        block_tables=[np.arange(-(-(c + n) // BLOCK)) + 10 * i for i, (c, n) in enumerate(zip(cached, lengths))],
        slot_mapping=np.arange(T) + 100,
        logits_rows=ends - 1 if logits else np.zeros(0, np.int64),
    )


def test_a_prefill_pads_to_its_bucket_with_one_padding_sequence(monkeypatch):
    d = host_decoder(monkeypatch)
    d.forward(prompt([20, 13]))
    h = d.ws.host
    assert d.issued == [("layers", 48, MAX_SEQS + 1, False), ("head", MAX_TOKENS, 2)]
    np.testing.assert_array_equal(h["token_ids"][33:48], 0)
    np.testing.assert_array_equal(h["slot_mapping"][:48], np.r_[np.arange(33) + 100, np.full(15, -1)])
    np.testing.assert_array_equal(h["seq_starts"][: MAX_SEQS + 2], np.r_[0, 20, 33, np.full(MAX_SEQS - 1, 48)])
    np.testing.assert_array_equal(h["context_lens"][: MAX_SEQS + 1], np.r_[20, 13, np.zeros(MAX_SEQS - 1)])
    np.testing.assert_array_equal(h["logits_rows"][:2], [19, 32])
    # the upload covers the real sequences' block tables and the padding sequence's row, nothing further
    assert d.ws.metadata.uploads[-1] == (0, d.ws.metadata.end_of("block_tables", 3 * MAX_BLOCKS))


def test_a_chunk_without_logits_rows_runs_no_head_and_a_full_batch_uses_the_spare_slot(monkeypatch):
    d = host_decoder(monkeypatch)
    d.forward(prompt([7], logits=False))
    assert d.issued == [("layers", 8, MAX_SEQS + 1, False)]
    d.issued.clear()
    d.forward(prompt([1] * 15 + [7], cached=[5] * 15 + [0]))  # 16 sequences, 22 tokens -> 24
    assert d.issued == [("layers", 24, MAX_SEQS + 1, False), ("head", MAX_TOKENS, 16)]
    np.testing.assert_array_equal(d.ws.host["seq_starts"][MAX_SEQS : MAX_SEQS + 2], [22, 24])
    assert d.ws.host["context_lens"][MAX_SEQS] == 0


def test_a_prefill_head_pads_its_logits_rows_to_a_bucket_with_or_without_graphs(monkeypatch):
    """Three prompts' last positions: the head computes 4 rows (its graph bucket; eager steps too, so they compute
    what replays do), the fourth staged as a valid hidden row of the step; the step still hands over 3 rows."""
    for graphs in (True, False):
        d = host_decoder(monkeypatch, cuda_graphs=graphs)
        logits = d.forward(prompt([20, 13, 5]))
        assert d.issued == [("layers", 48, MAX_SEQS + 1, False), ("head", MAX_TOKENS, 4)]
        rows = d.ws.host["logits_rows"][:4]
        np.testing.assert_array_equal(rows[:3], [19, 32, 37])
        assert 0 <= rows[3] < 48
        assert len(logits) == 3 and (4 in d.head_graphs._seen) == graphs


def test_decode_steps_pad_to_their_batch_bucket_with_or_without_graphs(monkeypatch):
    for graphs in (True, False):
        d = host_decoder(monkeypatch, cuda_graphs=graphs)
        d._run = lambda T, S, R, decode, shared=False, d=d: d.issued.append(("run", T, S, R, decode))
        d.forward(prompt([1, 1, 1], cached=[4, 9, 2]))
        assert d.issued == [("run", 4, 4, 4, True)]
        np.testing.assert_array_equal(d.ws.host["seq_starts"][:5], [0, 1, 2, 3, 4])
        np.testing.assert_array_equal(d.ws.host["context_lens"][:4], [5, 10, 3, 0])
        assert (4 in d.graphs._seen) == graphs


def test_a_step_launched_behind_another_stages_and_reads_back_in_the_other_host_copy(monkeypatch):
    """Launch t, launch t+1 (fed from t's argmax rows), then finish t: t+1 staged into the other host copy, so t's
    staged metadata and its readback (argmax, flags) are intact when t is finished; fed rows are staged, -1 for
    tokens on the host and for padding."""
    d = host_decoder(monkeypatch)
    d._run = lambda T, S, R, decode, shared=False: d.issued.append(("run", T, S, R, decode))
    first = d.launch(prompt([1, 1, 1], cached=[4, 9, 2]), traced=True)
    first_ids = d.ws.results.twin_views[first.twin]
    first_ids["greedy_ids"][:3], first_ids["nonfinite"][:3] = [7, 8, 9], [0, 1, 0]  # what t's readback brings
    second = d.launch(replace(prompt([1, 1], cached=[5, 3]), fed_rows=np.array([2, -1], np.int32)))
    assert first.twin != second.twin
    t, t1 = d.ws.metadata.twin_views[first.twin], d.ws.metadata.twin_views[second.twin]
    np.testing.assert_array_equal(t["context_lens"][:4], [5, 10, 3, 0])
    np.testing.assert_array_equal(t["feed_rows"][:4], -1)
    np.testing.assert_array_equal(t1["context_lens"][:2], [6, 4])
    np.testing.assert_array_equal(t1["feed_rows"][:2], [2, -1])
    with pytest.raises(RuntimeError, match="finish the oldest"):
        d.launch(prompt([1], cached=[3]))  # a third step would restage the first one's host copy
    logits = d.finish(first)
    assert [logits.greedy(r) for r in range(3)] == [(7, True), (8, False), (9, True)]
    with pytest.raises(RuntimeError, match="overwrote"):
        logits[0]  # t's rows on the device belong to t+1 now
    d.finish(second)
    d.launch(prompt([1], cached=[3]))
    d.launch(prompt([1], cached=[4]))
    d.abandon()  # a fault: neither is finished, both host copies are free again
    d.finish(d.launch(prompt([1], cached=[5])))


def test_per_expert_cublas_steps_pad_to_their_bucket_and_replay(monkeypatch):
    """fp32 experts: per-expert cuBLAS above 64 tokens; its pass is captured in pieces around the host's GEMMs,
    so a 100-token prefill pads to the 128 bucket and goes through the prefill graphs like smaller ones."""
    d = host_decoder(monkeypatch)
    d.forward(prompt([100]))
    assert d.issued == [("layers", 128, MAX_SEQS + 1, False), ("head", MAX_TOKENS, 1)]
    assert 128 in d.prefill_graphs._seen and 1 in d.head_graphs._seen


def cached_stub(d):
    """An expert cache that records what the decoder asks of it."""
    return SimpleNamespace(
        stage_hints=lambda hints, twin, tokens: d.issued.append(("hints", hints is not None, twin)),
        download_stats=lambda twin: d.issued.append(("stats", twin)),
        step_stats=lambda twin: d.issued.append(("collect", twin)),
        settle_totals=lambda: d.issued.append("settle"),
        slots=SimpleNamespace(slots_per_layer=2),  # one-token steps fit (the tiny model's top-2): CACHED_GEMV
    )


def test_steps_with_the_expert_cache_pad_and_replay_like_resident_ones(monkeypatch):
    """The expert cache decides on the device: its prefills pad to their token bucket and replay graphs, its
    decodes take the batch buckets; each step stages its plan first and its counters come back behind it."""
    d = host_decoder(monkeypatch)
    d.cached = cached_stub(d)
    d.forward(prompt([100]))
    assert d.issued == [
        ("hints", False, 1),
        ("layers", 128, MAX_SEQS + 1, False),
        ("head", MAX_TOKENS, 1),
        ("stats", 1),
        ("collect", 1),
    ]
    assert 128 in d.prefill_graphs._seen and d.supports_overlap
    d.issued.clear()
    d._run = lambda T, S, R, decode, shared=False: d.issued.append(("run", T, S, R, decode))
    d.forward(prompt([1, 1, 1], cached=[4, 9, 2]))
    assert d.issued == [("hints", False, 0), ("run", 4, 4, 4, True), ("stats", 0), ("collect", 0)]
    assert 4 in d.graphs._seen


def test_warmup_captures_every_replayable_bucket_and_decode_bucket(monkeypatch):
    d = host_decoder(monkeypatch)
    d._run = lambda T, S, R, decode, shared=False: d.issued.append(("run", T, S, R, decode))
    d.warmup()
    assert set(d.prefill_graphs) == set(prefill_buckets(MAX_TOKENS))  # per-expert cuBLAS ones in pieces
    assert set(d.graphs) == {1, 2, 4, 8, 16}
    assert set(d.head_graphs) == {1, 2, 4, 8, 16}  # padded steps' LM heads, by logits-row bucket
    assert ("cublas shapes", MAX_TOKENS) in d.issued  # steps above 64 tokens run per-expert cuBLAS GEMMs
    many = host_decoder(monkeypatch, family="qwen3_moe", bf16=True)
    many.config = config_from_hf({**tiny_hf_config("qwen3_moe"), "num_experts": 40, "num_experts_per_tok": 8})
    many._run = lambda T, S, R, decode, shared=False: many.issued.append(("run", T, S, R, decode))
    many.max_blocks_per_seq = 4  # 32-token sequences: buckets above 32 take several of them
    many.warmup()
    assert set(many.prefill_graphs) == set(prefill_buckets(MAX_TOKENS))
    assert ("layers", 512, MAX_SEQS + 1, False) in many.issued and not any(
        step[0] == "run" and step[1] > 64 for step in many.issued
    )
    assert not any(step[0] == "cublas shapes" for step in many.issued)  # grouped MMA at every size


def test_the_all_rows_path_pads_and_chunks_its_head(monkeypatch):
    """More logits rows than max_batch_size (every prompt position): the layers pad to the bucket as a sampling
    step would, and the head runs in chunks of max_batch_size rows over the padded hidden rows."""
    d = host_decoder(monkeypatch)
    batch = prompt([40])
    batch = ForwardBatch(
        batch.token_ids,
        batch.positions,
        batch.seq_starts,
        batch.context_lens,
        batch.block_tables,
        batch.slot_mapping,
        np.arange(40),
    )
    out = d.forward(batch)
    assert d.issued == [("layers", 48, MAX_SEQS + 1, False), ("head", 48, 16), ("head", 48, 16), ("head", 48, 8)]
    assert np.asarray(out.rows if hasattr(out, "rows") else out[0]).shape[-1] == d.config.vocab_size


def test_prefill_graphs_off_means_unpadded_eager_steps(monkeypatch):
    d = host_decoder(monkeypatch, options=CudaOptions(prefill_graphs=False))
    d._run = lambda T, S, R, decode, shared=False: d.issued.append(("run", T, S, R, decode))
    d.forward(prompt([33]))
    assert d.issued == [("run", 33, 1, 1, False)]


def test_set_options_drops_the_graphs_and_hands_the_options_to_the_model(monkeypatch):
    """A graph keeps the path it was captured with: new options must not replay the old options' graphs."""
    d = host_decoder(monkeypatch)
    d.model.use_options = lambda options: setattr(d.model, "options", options)
    d.forward(prompt([33]))
    assert 48 in d.prefill_graphs._seen
    d.set_options(CudaOptions(prefill_graphs=False))
    assert not d.prefill_graphs._seen and not d.head_graphs._seen
    assert d.options == CudaOptions(prefill_graphs=False)
    d._run = lambda T, S, R, decode, shared=False: d.issued.append(("run", T, S, R, decode))
    d.issued.clear()
    d.forward(prompt([33]))
    assert d.issued == [("run", 33, 1, 1, False)]


def test_decode_steps_sharing_prefix_blocks_replay_graphs_of_their_own(monkeypatch):
    """With shared_prefix_attention laid out, warm-up captures each decode bucket with and without shared
    prefixes; a decode step whose sequences' tables start with the same blocks stages its groups and replays the
    shared graph of its bucket, one without such sequences the usual graph, and prefills never share."""
    on = CudaOptions(shared_prefix_attention=True)
    warm = host_decoder(monkeypatch, bf16=True, options=on, shared_members=2)
    warm.warmup()
    assert set(warm.graphs) == {1, 2, 4, 8, 16} | {(b, True) for b in (1, 2, 4, 8, 16)}
    d = host_decoder(monkeypatch, bf16=True, options=on, shared_members=2)  # each graph's first step runs eagerly
    system = np.arange(100, 108)  # eight blocks of 8 keys: 64 keys, shared_prefix.MIN_SHARED_KEYS
    tables = [np.concatenate([system, [200 + i]]) for i in range(3)]
    step = replace(prompt([1, 1, 1], cached=[66, 70, 68]), block_tables=tables)
    d.forward(step)
    assert d.issued == [("layers", 4, 4, True, "shared"), ("head", 4, 4)] and (4, True) in d.graphs._seen
    h = d.ws.host
    assert h["share_starts"][:4].tolist() == [64, 64, 0, 0]  # groups of 2: the third sequence alone
    assert h["share_members"][0].tolist() == [0, 1] and (h["share_members"][1:4] == -1).all()
    d.issued.clear()
    d.forward(prompt([1, 1, 1], cached=[66, 70, 68]))  # each sequence's own blocks
    d.forward(prompt([20, 13]))
    assert d.issued[0] == ("layers", 4, 4, True) and ("layers", 48, MAX_SEQS + 1, False) in d.issued
    off = host_decoder(monkeypatch, bf16=True, options=CudaOptions(), shared_members=2)  # laid out, then off
    off.forward(step)
    assert off.issued == [("layers", 4, 4, True), ("head", 4, 4)]
