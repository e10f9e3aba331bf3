"""The expert cache's copy engine on the CPU backend, a simulated one. Slots are float32 buffers allocated
once; a copy reads the expert's one contiguous block (matrices and, for 8-bit experts, their scales) from the
model's mmap and widens or dequantises it into the slot on a single background thread, which stands in for
the GPU's copy stream: copies run in issue order and overlap with the numpy compute on the model thread
(numpy releases the GIL). Copies are accounted as the stored block's bytes — what a host-to-device copy
would move.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from common import dtypes, quant
from common.model_format import ModelDir


class HostCopyEngine:
    """Float32 slot buffers [layer][slot] = (gate [F, D], up [F, D], down [D, F]) and a one-thread copier."""

    def __init__(self, model: ModelDir, moe_layers: list[int], slots_per_layer: int):
        self.model = model
        self._shapes = model.expert_layout(moe_layers[0], 0).weight_shapes  # every expert's, whatever its dtype
        self.slots = {
            layer: [tuple(np.zeros(s, dtype=np.float32) for s in self._shapes) for _ in range(slots_per_layer)]
            for layer in moe_layers
        }
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="colibri-expert-copy")

    @property
    def nbytes(self) -> int:
        """Host bytes of the float32 slot buffers."""
        return sum(a.nbytes for layer in self.slots.values() for slot in layer for a in slot)

    def weights(self, layer: int, slot: int) -> tuple[np.ndarray, ...]:  # gate, up, down
        return self.slots[layer][slot]

    def copy(self, layer: int, expert: int, slot: int) -> Future:
        return self._executor.submit(self._copy, layer, expert, slot)

    def _copy(self, layer: int, expert: int, slot: int) -> None:
        layout = self.model.expert_layout(layer, expert)
        block = self.model._map(layout.file)[layout.offset : layout.offset + layout.nbytes]  # the one copy
        storage = dtypes.STORAGE[layout.dtype]
        for i, (dst, shape) in enumerate(zip(self.slots[layer][slot], layout.weight_shapes)):
            start = layout.weight_offsets[i]
            src = block[start : start + shape[0] * shape[1] * storage.itemsize].view(storage).reshape(shape)
            if layout.scheme is not None:
                at, scale_shape = layout.scale_offsets[i], layout.scale_shapes[i]
                scale = block[at : at + 4 * int(np.prod(scale_shape))].view(np.float32).reshape(scale_shape)
                np.copyto(dst, quant.dequantize(src, scale, layout.dtype, layout.scheme))
            elif layout.dtype == "bfloat16":  # widen in place: bf16 words are the top half of a float32
                bits = dst.view(np.uint32)
                np.copyto(bits, src)
                bits <<= 16
            else:
                np.copyto(dst, src)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
