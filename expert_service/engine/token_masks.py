"""Token masks of constrained sequences (grammar masks computed on the router) and their host application.

A mask is ceil(V / 32) uint32 words, bit i of word j allowing token 32 j + i (llguidance's and xgrammar's
layout). A step's masks form one [R, W] array over its first R logits rows (the sampling rows, in work order);
an unconstrained row is all ones. The worker sets every disallowed logit to -inf after the penalties and before
the logit bias, stop-id suppression and temperature, so greedy, sampled and log-probabilities all read the
constrained distribution. This module is also the numpy reference of the cuda kernel (kernels/apply_token_mask.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set

import numpy as np

from common.errors import InvalidRequestError

ALL_ALLOWED = np.uint32(0xFFFFFFFF)


def mask_words(vocab_size: int) -> int:
    """uint32 words of one sequence's mask."""
    return -(-vocab_size // 32)


def allowed(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool [V]: the tokens a mask allows."""
    bits = np.unpackbits(np.ascontiguousarray(words, "<u4").view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


def masked_allowed(masks: np.ndarray | None, row: int, vocab_size: int) -> np.ndarray | None:
    """bool [V] of a step's row, or None when the row has no mask or allows every token."""
    if masks is None or row >= len(masks) or (masks[row] == ALL_ALLOWED).all():
        return None
    return allowed(masks[row], vocab_size)


def apply_mask(logits: np.ndarray, words: np.ndarray) -> np.ndarray:
    """A copy of `logits` [V] float32 with every token the mask disallows at -inf."""
    out = np.array(logits, np.float32, copy=True)
    out[~allowed(words, out.shape[-1])] = -np.inf
    return out


def apply_masks_reference(logits: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """[R, V] logits masked by [R, W] words: the reference of the cuda kernel."""
    return np.stack([apply_mask(row, words) for row, words in zip(logits, masks)]) if len(masks) else logits[:0]


def check_masks(masks: np.ndarray, vocab_size: int, request_ids, field: str = "token_masks") -> None:
    """Each mask allows at least one token and nothing past the vocabulary (one named sequence on failure)."""
    W = mask_words(vocab_size)
    if masks.ndim != 2 or masks.shape[1] != W:
        raise InvalidRequestError(field, f"masks must be [sequences, {W}] uint32 words, got {list(masks.shape)}")
    tail = vocab_size - 32 * (W - 1)  # valid bits of the last word
    over = masks[:, -1] >> np.uint32(tail) if tail < 32 else np.zeros(len(masks), np.uint32)
    empty = [not row.any() for row in masks]
    for rid, bad_tail, is_empty in zip(request_ids, (over != 0).tolist(), empty):
        if bad_tail or is_empty:
            why = "allows no token" if is_empty else f"allows ids past the vocabulary ({vocab_size})"
            raise InvalidRequestError(field, f"sequence {rid}: the mask {why}")


def _words(masks: Mapping[int, np.ndarray], ids: Sequence[int], vocab: int, field: str) -> np.ndarray:
    W = mask_words(vocab)
    words = [np.asarray(masks[rid]) for rid in ids]
    if any(w.dtype != np.uint32 or w.shape != (W,) for w in words):
        raise InvalidRequestError(field, f"each mask must be {W} uint32 words")
    stacked = np.stack(words) if words else np.zeros((0, W), np.uint32)
    check_masks(stacked, vocab, ids, field)
    return stacked


def step_masks(
    sampling: Sequence[int],
    constrained: Sequence[bool],
    masks: Mapping[int, np.ndarray],
    unknown: Set[int],
    vocab: int,
    deferrable: Set[int] = frozenset(),
) -> tuple[np.ndarray | None, dict[int, int]]:
    """A step's [R, W] masks over its sampling rows (`sampling`: their sequences in row order; `constrained`: which
    are) up to the last constrained one, all ones for an unconstrained row; None when no constrained sequence
    samples. `masks` must name exactly the constrained ones, but for those in `deferrable` (plain greedy decodes),
    whose masks may come late: their rows stay all ones here and come back as {sequence: row}. A mask of an
    `unknown` decode (freed) is dropped."""
    rows = [i for i, flag in enumerate(constrained) if flag]
    expected = {sampling[i] for i in rows}
    late = {sampling[i]: i for i in rows if sampling[i] not in masks and sampling[i] in deferrable}
    missing = [sampling[i] for i in rows if sampling[i] not in masks and sampling[i] not in late]
    if missing:
        raise InvalidRequestError("token_masks", f"sequence {missing[0]} is constrained: it needs a mask here")
    extra = sorted(set(masks) - expected - set(unknown))
    if extra:
        raise InvalidRequestError("token_masks", f"sequence {extra[0]} is no constrained sequence sampling here")
    if not rows:
        return None, late
    on_time = [i for i in rows if sampling[i] not in late]
    out = np.full((rows[-1] + 1, mask_words(vocab)), ALL_ALLOWED, np.uint32)
    out[on_time] = _words(masks, [sampling[i] for i in on_time], vocab, "token_masks")
    return out, late


def with_late_masks(
    on_time: np.ndarray, late: Mapping[int, int], masks: Mapping[int, np.ndarray], excused: Set[int], vocab: int
) -> np.ndarray:
    """A launched step's full [R, W] masks: its on-time ones with the `late` rows ({sequence: row}) filled from
    `masks`, which must hold each of them but the `excused` (freed since: their rows allow every token) and no
    other sequence."""
    extra = sorted(set(masks) - set(late))
    if extra:
        raise InvalidRequestError("late_token_masks", f"sequence {extra[0]} has no row waiting for a late mask")
    missing = sorted(rid for rid in late if rid not in masks and rid not in excused)
    if missing:
        raise InvalidRequestError("late_token_masks", f"sequence {missing[0]} is waiting for its late mask")
    given = [rid for rid in late if rid in masks]
    out = on_time.copy()
    out[[late[rid] for rid in given]] = _words(masks, given, vocab, "late_token_masks")
    return out
