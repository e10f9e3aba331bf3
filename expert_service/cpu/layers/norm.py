import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x [..., N] * rsqrt(mean(x^2) + eps) * weight [N], in float32 like HF's RMSNorm."""
    variance = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
    return (x / np.sqrt(variance + np.float32(eps))).astype(np.float32) * weight
