"""Rotary position embedding, rotate-half (NeoX) layout as in all four families."""

import numpy as np

from common.model_config import RopeConfig


class Rotary:
    def __init__(self, rope: RopeConfig, head_dim: int):
        self.inv_freq, self.scale = rope.inverse_frequencies(head_dim)

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """positions [T] -> cos, sin [T, Hd] (frequencies repeated over both halves)."""
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)
        return (np.cos(emb) * np.float32(self.scale)).astype(np.float32), (np.sin(emb) * np.float32(self.scale)).astype(
            np.float32
        )


def apply_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, Hd] rotated by cos/sin [T, Hd]."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
