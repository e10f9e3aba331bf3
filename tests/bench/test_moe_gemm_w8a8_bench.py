"""bench/moe_gemm_w8a8.py's random 8-bit layers (no GPU): every code finite (no e4m3 NaN, no int8 -128), the block
layout and meta the kernels read, and weights of the size quantized ones have."""

import numpy as np
import pytest

from bench.moe_gemm_w8a8 import KINDS, random_layer
from expert_service.kernels import expert_quant as q


@pytest.mark.parametrize("kind", list(KINDS))
def test_random_layer_is_a_valid_8bit_layer(kind):
    code, scheme = KINDS[kind]
    F, D = 256, 384
    blocks, meta = random_layer(np.random.default_rng(3), 3, F, D, code, scheme)
    assert blocks.shape[1] % 4096 == 0 and meta.shape == (3, q.META_WIDTH)
    assert q.layer_kinds(meta) == ((code, scheme),)
    for e in range(3):
        mats = q.dequantize(blocks[e], meta[e], F, D)
        for m, fan_in in zip(mats, (D, D, F)):
            assert np.isfinite(m).all()
            assert 0.2 / np.sqrt(fan_in) < m.std() < 5 / np.sqrt(fan_in)
        raw = blocks[e, : meta[e, 3]]
        if code == q.CODE_INT8:
            assert (raw != 0x80).all()
        else:
            assert ((raw & 0x7F) != 0x7F).all()
