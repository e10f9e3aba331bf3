"""Model weights on the device, uploaded from the read-only mmaps of the model directory.

The dense file goes up as one device buffer and each MoE layer's experts file as another (the format lays
every expert out as one aligned block, so a layer is one copy and an expert one range of it); tensors are
typed zero-copy views into those buffers. Host ranges are page-locked with cuMemHostRegister(READ_ONLY)
so copies run at PCIe speed; where the driver refuses, copies go through a pinned bounce buffer, said once.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from numba import cuda

from common import dtypes
from common.attention_format import AttentionFormat
from common.errors import ConfigError
from common.model_config import ModelConfig
from common.model_format import ModelDir
from common.model_manifest import DENSE_FILE, expert_file
from expert_service.cuda.driver import pin_readonly, unpin
from expert_service.cuda.linear_8bit import Matrix8Bit
from expert_service.cuda.moe_grouped_mma import every_layer_w8a8
from expert_service.kernels import expert_quant
from expert_service.kernels.linear_q8 import matrix_meta

if TYPE_CHECKING:
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

log = logging.getLogger("colibri.worker.cuda")
BOUNCE_BYTES = 64 * 1024 * 1024


class HostUploader:
    """Copies host byte ranges of the model's mmaps to device buffers, pinned when the driver allows."""

    def __init__(self, stream, use_pinned_memory: bool = True):
        self.stream = stream
        self.use_pinned_memory = use_pinned_memory
        self._bounce: np.ndarray | None = None  # pinned, allocated by the first copy that needs it
        self._warned = False
        self.pinned: list[np.ndarray] = []
        self.bytes_copied = 0
        # An uploader dropped without release() must still unpin before its mmaps go: a registration that
        # outlives its mapping makes the driver refuse the next allocation or mmap placed at those addresses.
        self._release = weakref.finalize(self, _unpin_all, self.pinned)

    def pin(self, host: np.ndarray, mapped: bool = False) -> bool:
        if self.use_pinned_memory and pin_readonly(host, mapped):
            self.pinned.append(host)
            return True
        if self.use_pinned_memory and not self._warned:
            log.warning(
                "page-locking the model mmaps failed; copying through a %d MiB pinned bounce buffer "
                "(slower host-to-device copies)",
                BOUNCE_BYTES >> 20,
            )
            self._warned = True
        return False

    def copy(self, host: np.ndarray, device, pinned: bool) -> None:
        """host: uint8 [n] (a slice of a mmap); device: uint8 [n] device array."""
        if pinned:
            device.copy_to_device(host, stream=self.stream)
        else:
            if self._bounce is None:
                self._bounce = cuda.pinned_array(BOUNCE_BYTES, dtype=np.uint8)
            for start in range(0, host.nbytes, BOUNCE_BYTES):
                n = min(BOUNCE_BYTES, host.nbytes - start)
                self._bounce[:n] = host[start : start + n]
                device[start : start + n].copy_to_device(self._bounce[:n], stream=self.stream)
                self.stream.synchronize()  # the bounce buffer is reused by the next chunk
        self.bytes_copied += host.nbytes

    def release(self) -> None:
        self._release()


def _unpin_all(pinned: list[np.ndarray]) -> None:
    for host in pinned:
        unpin(host)
    pinned.clear()


def stacked_range(entries) -> tuple[int, int, str, tuple[int, ...]] | None:
    """(offset, bytes, dtype, shape) of dense tensors stored back to back as one tensor of their rows stacked, or
    None where one is missing, lives elsewhere, differs in dtype or row shape, or the format padded between them
    (its 64-byte alignment)."""
    if not entries or any(e is None or e.file != DENSE_FILE for e in entries):
        return None
    first, last = entries[0], entries[-1]
    if any(e.dtype != first.dtype or tuple(e.shape[1:]) != tuple(first.shape[1:]) for e in entries) or any(
        a.offset + a.nbytes != b.offset for a, b in zip(entries, entries[1:])
    ):
        return None
    return (
        first.offset,
        last.offset + last.nbytes - first.offset,
        first.dtype,
        (sum(e.shape[0] for e in entries),) + tuple(first.shape[1:]),
    )


def expert_meta(model: ModelDir, layer: int) -> np.ndarray:
    """[E, META_WIDTH] int32: each expert's dtype code, scale scheme and six tensor offsets (expert_quant)."""
    rows = []
    for j in range(model.config.num_experts):
        layout = model.expert_layout(layer, j)
        if layout.dtype not in expert_quant.CODES:
            raise ValueError(
                f"{model.path}: expert {j} of layer {layer} is {layout.dtype}; the cuda kernels for 8-bit layers read "
                f"int8, float8_e4m3fn, bfloat16 and float16 experts"
            )
        offsets = layout.weight_offsets + (layout.scale_offsets or (layout.nbytes,) * 3)
        rows.append(
            expert_quant.meta_row(expert_quant.CODES[layout.dtype], expert_quant.SCHEMES[layout.scheme], offsets)
        )
    return np.stack(rows)


EIGHT_BIT_CODES = (expert_quant.CODE_INT8, expert_quant.CODE_FP8)


def _back_to_back_experts(model: ModelDir) -> bool:
    """Whether every expert's gate, up and down lie back to back from its block's start (what the dense-dtype
    kernels assume; a version-2 block pads a matrix whose size is not a multiple of 256 bytes)."""
    F, D = model.config.moe_intermediate_size, model.config.hidden_size
    size = F * D * model_itemsize(model)
    return all(
        model.expert_layout(layer, j).weight_offsets == (0, size, 2 * size)
        for layer in model.config.moe_layers
        for j in range(model.config.num_experts)
    )


def model_itemsize(model: ModelDir) -> int:
    return np.dtype(dtypes.STORAGE[model.dtype]).itemsize


@dataclass(frozen=True)
class ExpertFacts:
    """What the kernels a model's experts take depend on (moe_strategy.WeightKinds), read from the model directory
    alone: DeviceWeights takes them, and the device-memory check lays out the workspace with them before any upload."""

    dtype: np.dtype  # the dense dtype's storage
    # one expert stored otherwise than the dense dtype puts every layer on the 8-bit kernels (they read bf16
    # and fp16 experts too), so a layer's strategy never depends on which of its experts a step routes to
    quantized: bool
    all_8bit: bool  # every expert of every layer int8 / fp8: the grouped tensor-core kernel for 8-bit tiles applies
    meta: dict[int, np.ndarray]  # quantized: each MoE layer's expert_meta rows
    # each layer's (dtype code, scale scheme) pairs (moe_q8 compiles each)
    kinds: dict[int, tuple[tuple[int, int], ...]]
    w8a8_layers: bool  # every MoE layer resident and of one 8-bit kind W8A8 runs


def expert_facts(model: ModelDir, resident: bool) -> ExpertFacts:
    """The model's ExpertFacts with every expert on the device (resident) or behind the expert cache."""
    check_head_for_cuda(model)  # the other 8-bit matrices, checked as early
    cfg = model.config
    quantized = model.expert_formats not in ((), (model.dtype,)) or not _back_to_back_experts(model)
    meta = {layer: expert_meta(model, layer) for layer in cfg.moe_layers} if quantized else {}
    all_8bit = quantized and all(bool(np.isin(m[:, 0], EIGHT_BIT_CODES).all()) for m in meta.values())
    kinds = {layer: expert_quant.layer_kinds(m) for layer, m in meta.items()}
    F, D = cfg.moe_intermediate_size, cfg.hidden_size
    resident_layers = dict.fromkeys(cfg.moe_layers if resident else ())
    w8a8 = all_8bit and every_layer_w8a8(F, D, resident_layers, kinds, model.expert_strides)
    return ExpertFacts(np.dtype(dtypes.STORAGE[model.dtype]), quantized, all_8bit, meta, kinds, w8a8)


class Projections8Bit(NamedTuple):
    """One layer's 8-bit attention projections: q|k|v stacked (one launch at one token), q, k and v (views of the
    same block: their own codes and scales) and o."""

    qkv: Matrix8Bit
    q: Matrix8Bit
    k: Matrix8Bit
    v: Matrix8Bit
    o: Matrix8Bit


def projection_metas(code: int, qkv_scale_offset: int, o_scale_offset: int, D: int, nq: int, nkv: int) -> np.ndarray:
    """One layer's linear_q8.matrix_meta rows [4, META_WIDTH]: q|k|v (and q: the same offsets, fewer rows), k, v
    (their codes and scales inside the stacked block) and o, each offset within its block."""
    return np.concatenate(
        [
            matrix_meta(code, qkv_scale_offset),
            matrix_meta(code, qkv_scale_offset + 4 * nq, nq * D),
            matrix_meta(code, qkv_scale_offset + 4 * (nq + nkv), (nq + nkv) * D),
            matrix_meta(code, o_scale_offset),
        ]
    )


def attention_metas(fmt: AttentionFormat, config: ModelConfig) -> np.ndarray:
    """Every layer's projection_metas [layers, 4, META_WIDTH]."""
    code, D, nq, nkv = expert_quant.CODES[fmt.dtype], config.hidden_size, config.q_size, config.kv_size
    return np.stack([projection_metas(code, b.qkv_scale_offset, b.o_scale_offset, D, nq, nkv) for b in fmt.layers])


def layer_projections(qkv, o, meta, host_meta: np.ndarray, code: int, D: int, nq: int, nkv: int) -> Projections8Bit:
    """Projections8Bit of one layer: qkv and o its two blocks on the device, meta its projection_metas rows there
    and host_meta the same rows on the host."""
    rows = [meta[j : j + 1] for j in range(4)]
    host = [expert_quant.shared_layout(host_meta[j : j + 1]) for j in range(4)]  # each a one-expert layer's row
    return Projections8Bit(
        qkv=Matrix8Bit(qkv, rows[0], code, nq + 2 * nkv, D, host[0]),
        q=Matrix8Bit(qkv, rows[0], code, nq, D, host[0]),
        k=Matrix8Bit(qkv, rows[1], code, nkv, D, host[1]),
        v=Matrix8Bit(qkv, rows[2], code, nkv, D, host[2]),
        o=Matrix8Bit(o, rows[3], code, D, nq, host[3]),
    )


def check_head_for_cuda(model: ModelDir) -> None:
    """An 8-bit LM head runs on linear_q8, whose rows are whole 16-byte chunks: hidden_size a multiple of 16. Any
    other is refused in one line (a ConfigError, as the worker prints it) before anything is uploaded."""
    D = model.config.hidden_size
    if model.head_format is not None and D % 16:
        raise ConfigError(
            f"backend: the cuda backend runs an 8-bit lm_head only with hidden_size a multiple of 16, and "
            f"{model.path} has {model.head_format.dtype} lm_head with hidden_size {D}; convert with --head-dtype "
            f"{model.dtype}, or use --backend cpu"
        )


class DeviceWeights:
    """Typed device views of every tensor; experts as one [E, stride_elems] array per MoE layer in the dense
    dtype, or, when any expert of the model is 8-bit (`quantized`), as uint8 [E, stride bytes] per layer with
    `expert_meta[layer]` [E, META_WIDTH] int32 on the device saying each expert's dtype and tensors."""

    def __init__(
        self,
        model: ModelDir,
        stream,
        use_pinned_memory: bool = True,
        load_experts: bool = True,
        facts: ExpertFacts | None = None,
    ):
        """facts: expert_facts(model, resident=load_experts), when the caller has read them already."""
        self.model = model
        self.config = model.config
        facts = facts if facts is not None else expert_facts(model, resident=load_experts)
        self.dtype = facts.dtype
        self.uploader = HostUploader(stream, use_pinned_memory)
        dense_host = model._map(DENSE_FILE)
        self.dense_buffer = cuda.device_array(dense_host.nbytes, dtype=np.uint8, stream=stream)
        self.uploader.copy(dense_host, self.dense_buffer, self.uploader.pin(dense_host))
        self.views: dict[str, object] = {}
        for name, entry in model.entries.items():
            if entry.file == DENSE_FILE:
                raw = self.dense_buffer[entry.offset : entry.offset + entry.nbytes]
                self.views[name] = raw.view(dtypes.STORAGE[entry.dtype]).reshape(entry.shape)
        self.head_8bit: Matrix8Bit | None = None
        if (head := model.head_format) is not None:  # its codes and scales: one range of the dense buffer
            code = expert_quant.CODES[head.dtype]
            host_meta = matrix_meta(code, head.scale_offset)
            meta = cuda.to_device(host_meta, stream=stream)
            block = self.dense_buffer[head.offset : head.offset + head.nbytes]
            V, D = self.config.vocab_size, self.config.hidden_size
            self.head_8bit = Matrix8Bit(block, meta, code, V, D, expert_quant.shared_layout(host_meta))
        self.attention_8bit = self._attention_8bit(model.attention_format, stream)
        for i in range(self.config.num_hidden_layers):  # one matrix where the format stored them back to back
            for fused, parts in (
                ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                ("qkv_bias", ("q_bias", "k_bias", "v_bias")),
            ):
                view = self._back_to_back(model, [f"layers.{i}.{p}" for p in parts])
                if view is not None:
                    self.views[f"layers.{i}.{fused}"] = view
        self.experts: dict[int, DeviceNDArray] = {}
        self.expert_host: dict[int, np.ndarray] = {}
        self.expert_pinned: dict[int, bool] = {}
        self.expert_meta: dict[int, DeviceNDArray] = {}
        self.expert_meta_host: dict[int, np.ndarray] = {}  # the same rows on the host (read at load, never per step)
        # the row every expert of a layer shares (one encoding, one block layout), None where they differ: the
        # 8-bit launches then take its offsets as arguments
        self.expert_layout: dict[int, tuple[int, ...] | None] = {}
        self.expert_kinds = facts.kinds  # each layer's (dtype code, scale scheme) pairs: moe_q8 compiles each
        self.expert_strides: dict[int, int] = {}  # bytes from one expert's block to the next, per MoE layer
        self.quantized, self.all_8bit, self.w8a8_layers = facts.quantized, facts.all_8bit, facts.w8a8_layers
        E = self.config.num_experts
        for layer in self.config.moe_layers:
            stride = self.expert_strides[layer] = model.expert_strides[layer]
            host = model._map(expert_file(layer))[: E * stride]
            self.expert_host[layer] = host
            # the expert cache's fetch kernels read the experts straight from host memory: mapped
            self.expert_pinned[layer] = self.uploader.pin(host, mapped=not load_experts)
            if self.quantized:
                self.expert_meta[layer] = cuda.to_device(facts.meta[layer], stream=stream)
                self.expert_meta_host[layer] = facts.meta[layer]
                self.expert_layout[layer] = expert_quant.shared_layout(facts.meta[layer])
            if load_experts:
                buffer = cuda.device_array(host.nbytes, dtype=np.uint8, stream=stream)
                self.uploader.copy(host, buffer, self.expert_pinned[layer])
                unit = np.dtype(np.uint8) if self.quantized else self.dtype
                self.experts[layer] = buffer.view(unit).reshape(E, stride // unit.itemsize)
        stream.synchronize()

    def _attention_8bit(self, fmt: AttentionFormat | None, stream) -> tuple[Projections8Bit, ...] | None:
        """Each layer's 8-bit projections as views of the dense buffer (the format's two blocks a layer), their
        meta rows in one upload."""
        if fmt is None:
            return None
        cfg, code = self.config, expert_quant.CODES[fmt.dtype]
        host_meta = attention_metas(fmt, cfg)
        self.attention_meta = cuda.to_device(host_meta, stream=stream)
        buffer = self.dense_buffer
        return tuple(
            layer_projections(
                buffer[b.qkv_offset : b.qkv_offset + b.qkv_nbytes],
                buffer[b.o_offset : b.o_offset + b.o_nbytes],
                self.attention_meta[i],
                host_meta[i],
                code,
                cfg.hidden_size,
                cfg.q_size,
                cfg.kv_size,
            )
            for i, b in enumerate(fmt.layers)
        )

    def _back_to_back(self, model: ModelDir, names: list[str]):
        stacked = stacked_range([model.entries.get(n) for n in names])
        if stacked is None or stacked[2] in dtypes.QUANTIZED_DTYPES:  # 8-bit codes are attention_8bit's, not weights
            return None
        offset, nbytes, dtype, shape = stacked
        return self.dense_buffer[offset : offset + nbytes].view(dtypes.STORAGE[dtype]).reshape(shape)

    def get(self, name: str):
        return self.views[name]

    def layer(self, i: int, name: str):
        return self.views.get(f"layers.{i}.{name}")

    def close(self) -> None:
        """Unpins the host ranges (a later model in the same process may map the same addresses)."""
        self.uploader.release()

    @property
    def lm_head(self):
        """The head in the dense dtype (an 8-bit one is `head_8bit`)."""
        if self.head_8bit is not None:
            raise ValueError("the LM head is 8-bit: read head_8bit")
        return self.views["embed_tokens"] if self.config.tie_word_embeddings else self.views["lm_head"]

    @property
    def dense_bytes(self) -> int:
        return self.dense_buffer.nbytes

    @property
    def expert_bytes(self) -> int:
        return sum(a.nbytes for a in self.experts.values())
