"""Top-n log-probabilities on the host against torch's log_softmax and topk; prompt chunks stitched across
chunk boundaries."""

from __future__ import annotations

import numpy as np
import torch

from expert_service.engine.logprobs import prompt_logprobs, token_logprobs, top_k_rows


def test_token_logprobs_match_torch():
    rng = np.random.default_rng()
    logits = (rng.standard_normal((6, 503)) * 5).astype(np.float32)
    tokens = rng.integers(0, 503, 6)
    out = token_logprobs(logits, tokens, 20)
    ref = torch.log_softmax(torch.tensor(logits, dtype=torch.float64), dim=-1)
    values, ids = torch.topk(ref, 20, dim=-1)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(6), tokens].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out.top_ids, ids.numpy())
    np.testing.assert_allclose(out.top_logprobs, values.numpy(), rtol=1e-5, atol=1e-5)
    assert out.top_ids.dtype == np.int32 and out.top_logprobs.dtype == np.float32


def test_ties_order_by_id_and_k_is_capped_by_the_vocabulary():
    ids, values = top_k_rows(np.array([[0.0, 1.0, 1.0, 0.5, 1.0]], np.float32), 3)
    assert ids.tolist() == [[1, 2, 4]] and values.tolist() == [[1.0, 1.0, 1.0]]
    ids, values = top_k_rows(np.array([[0.2, 0.1, 0.3]], np.float32), 20)
    assert ids.tolist() == [[2, 0, 1]]
    assert token_logprobs(np.zeros((2, 4), np.float32), np.array([1, 2]), 0).top_ids.shape == (2, 0)


def test_ties_across_the_kth_place_keep_the_lowest_ids():
    """Values tied at the k-th largest: the ones kept are the lowest ids, as a stable full sort keeps them."""
    rng = np.random.default_rng()
    logits = rng.integers(0, 4, (40, 97)).astype(np.float32)  # many ties in every row
    for k in (1, 3, 7, 20):
        ids, values = top_k_rows(logits, k)
        want = np.argsort(-logits, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(ids, want)
        np.testing.assert_array_equal(values, np.take_along_axis(logits, want, axis=1))


def test_prompt_chunks_stitch_to_the_whole_prompt():
    """Scoring a prompt in chunks (each chunk's first token under the previous chunk's last row) gives what
    scoring it whole gives; the prompt's first token has no distribution."""
    rng = np.random.default_rng()
    vocab, n = 61, 11
    tokens = rng.integers(0, vocab, n)
    rows = (rng.standard_normal((n, vocab)) * 3).astype(np.float32)  # row i predicts token i + 1
    whole = prompt_logprobs(rows[: n - 1], None, tokens, 4)
    parts, previous = [], None
    for start, end in ((0, 4), (4, 5), (5, 11)):
        parts.append(prompt_logprobs(rows[start : end - 1], previous, tokens[start:end], 4))
        previous = rows[end - 1]
    stitched = [np.concatenate([getattr(p, f) for p in parts]) for f in ("logprobs", "top_ids", "top_logprobs")]
    np.testing.assert_array_equal(stitched[1], whole.top_ids)
    np.testing.assert_allclose(stitched[0], whole.logprobs, rtol=1e-6)
    assert np.isnan(whole.logprobs[0]) and (whole.top_ids[0] == -1).all() and len(whole) == n
    ref = torch.log_softmax(torch.tensor(rows[: n - 1], dtype=torch.float64), -1)[np.arange(n - 1), tokens[1:]]
    np.testing.assert_allclose(whole.logprobs[1:], ref.numpy(), rtol=1e-5, atol=1e-5)
