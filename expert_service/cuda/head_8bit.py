"""The 8-bit LM head on the device: logits [R, V] = last [R, D] @ (q * scale)^T for the R sequences of a step.

Up to TOK_TILE rows the head is a weight stream (linear_q8: moe_q8's bodies, every byte read once in one pass).
More rows would re-stream the weights once per tile of TOK_TILE rows, so they go through the grouped tensor-core
GEMM of 8-bit experts instead (moe_gemm_q8mma, the head as the down projection of a one-expert layer): the rows
rounded to bf16 as cuBLAS takes a bf16 head's, the codes widened exactly in shared memory, the per-row scale
applied to each fp32 sum. Every row count's launch arguments are laid out when the model loads (three small
tables), so a captured head replays with no allocation and no host read.
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from expert_service.cuda.weights import EightBitHead
from expert_service.kernels.linear_q8 import launch_linear_q8, row_bounds
from expert_service.kernels.moe_align import launch_moe_gather_bf16
from expert_service.kernels.moe_gemm_q8mma import choose_config, launch_q8mma_down
from expert_service.kernels.moe_q8 import TOK_TILE

MMA_MIN_ROWS = TOK_TILE + 1  # fewer rows: one pass of the weight stream


def takes_mma(vocab_size: int, block_nbytes: int, max_rows: int) -> bool:
    """Whether a head of `vocab_size` rows, its codes and scales `block_nbytes` bytes, runs the tensor-core GEMM past
    TOK_TILE rows (its output tiles are whole 16-column groups)."""
    return vocab_size % 16 == 0 and block_nbytes % 16 == 0 and max_rows >= MMA_MIN_ROWS


def mma_tiles(max_rows: int) -> tuple[dict, dict[int, int], int]:
    """Each row count's GEMM config and tile count from MMA_MIN_ROWS to max_rows, and the widest rows they take."""
    configs = {r: choose_config(r, 1) for r in range(MMA_MIN_ROWS, max_rows + 1)}
    tiles = {r: -(-r // cfg.block_m) for r, cfg in configs.items()}
    return configs, tiles, max(t * configs[r].block_m for r, t in tiles.items())


def planned_nbytes(vocab_size: int, hidden_size: int, block_nbytes: int, max_rows: int) -> int:
    """The device bytes a DeviceHead8Bit of these sizes allocates beside the weights (its launch tables and the bf16
    rows the GEMM reads), for the device-memory plan: what __init__ allocates, from the sizes alone."""
    nbytes = (max_rows + 1) * 2 * 4 + 4  # bounds, first_row
    if takes_mma(vocab_size, block_nbytes, max_rows):
        _, tiles, width = mma_tiles(max_rows)
        # sorted_ids, num_tiles, tile_expert, rows_bf16
        nbytes += (max_rows + 1) * width * 4 + (max_rows + 1) * 4 + max(tiles.values()) * 4 + width * hidden_size * 2
    return nbytes


class DeviceHead8Bit:
    """Runs `head` for 1 to max_rows rows; V (vocab_size) a multiple of 16 takes the tensor-core GEMM past
    TOK_TILE rows (its output tiles are whole 16-column groups), any other V the weight stream at every count."""

    def __init__(self, head: EightBitHead, vocab_size: int, hidden_size: int, max_rows: int, stream):
        self.head, self.V, self.D, self.stream = head, vocab_size, hidden_size, stream
        self.bounds = cuda.to_device(row_bounds(max_rows), stream=stream)
        self.first_row = cuda.to_device(np.zeros((1, 1), np.int32), stream=stream)
        self.mma = takes_mma(vocab_size, head.block.size, max_rows)
        if not self.mma:
            return
        # row count r: config choose_config(r, 1), tiles(r) tiles of BM rows; sorted_ids row r = 0 .. r-1, then -1
        self.configs, tiles, width = mma_tiles(max_rows)
        sorted_ids = np.full((max_rows + 1, width), -1, np.int32)
        num_tiles = np.zeros((max_rows + 1, 1), np.int32)
        for r, t in tiles.items():
            sorted_ids[r, :r] = np.arange(r)
            num_tiles[r] = t
        self.tiles = tiles
        self.sorted_ids = cuda.to_device(sorted_ids, stream=stream)
        self.num_tiles = cuda.to_device(num_tiles, stream=stream)
        self.tile_expert = cuda.to_device(np.zeros(max(tiles.values()), np.int32), stream=stream)  # one expert
        self.rows_bf16 = cuda.device_array((width, hidden_size), np.uint16, stream=stream)
        self.block_2d = head.block.reshape(1, head.block.size)

    def run(self, last, logits) -> None:
        """last [R, D] float32 (final-normed hidden rows) -> logits [R, V] float32, every element written."""
        R = last.shape[0]
        head, st = self.head, self.stream
        if not self.mma or R < MMA_MIN_ROWS:
            launch_linear_q8(last, head.block, head.meta, head.code, self.V, logits, self.bounds, self.first_row, st)
            return
        cfg, rows = self.configs[R], self.tiles[R] * self.configs[R].block_m
        sorted_ids, num_tiles = self.sorted_ids[R, :rows], self.num_tiles[R]
        xs = self.rows_bf16[:rows]
        launch_moe_gather_bf16(last, sorted_ids, num_tiles, 1, cfg.block_m, xs, stream=st)
        tile_expert = self.tile_expert[: self.tiles[R]]
        launch_q8mma_down(
            xs, tile_expert, num_tiles, sorted_ids, self.block_2d, head.meta, self.D, self.V, logits, cfg, stream=st
        )
