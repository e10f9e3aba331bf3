"""The expert cache's copy engine on the CPU backend, a simulated one. Slots are float32 buffers allocated once; a copy reads the expert's one contiguous block from the
model's mmap and widens it into the slot on a single background thread, which stands in for the GPU's copy
stream: copies run in issue order and overlap with the numpy compute on the model thread (numpy releases
the GIL). Copies are accounted as the stored block's bytes — what a host-to-device copy would move.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from common import dtypes
from common.model_format import ModelDir


class HostCopyEngine:
    """Float32 slot buffers [layer][slot] = (gate [F, D], up [F, D], down [D, F]) and a one-thread copier."""

    def __init__(self, model: ModelDir, moe_layers: list[int], slots_per_layer: int):
        self.model = model
        prefix = f"layers.{moe_layers[0]}.experts.0."
        self._shapes = tuple(model.entries[prefix + p].shape for p in ("gate_proj", "up_proj", "down_proj"))
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
        file, offset, nbytes = self.model.expert_block(layer, expert)
        dtype = self.model.dtype
        block = self.model._map(file)[offset : offset + nbytes].view(dtypes.STORAGE[dtype])
        start = 0
        for dst, shape in zip(self.slots[layer][slot], self._shapes):
            n = shape[0] * shape[1]
            src = block[start : start + n].reshape(shape)
            start += n
            if dtype == "bfloat16":  # widen in place: bf16 words are the top half of a float32
                bits = dst.view(np.uint32)
                np.copyto(bits, src)
                bits <<= 16
            else:
                np.copyto(dst, src)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
