"""Numba CUDA kernels of the cuda backend: one op per module, each with its launcher and a docstring
giving every argument's shape. The numpy reference of each op is the CPU backend (expert_service/layers,
expert_service/moe_grouping.py, expert_service/engine/sampling.py); tests compare the two.

Conventions
- Shape legend: T tokens of the step, S sequences, D hidden, N/K output/input features of a linear,
  H query heads, Hkv KV heads, Hd head dim, E experts, K experts per token (top-k), F expert FFN size,
  V vocabulary, NB KV blocks, BS tokens per KV block.
- Activations are float32. Weights ("W" in docstrings) are uint16 (bfloat16 bits), float16 or float32:
  kernels are built per weight dtype by factories (``numeric.loader(dtype)``) and accumulate in float32.
- Index arrays are int32. Launchers take device arrays and a stream, allocate nothing, and check shapes.
- Under NUMBA_ENABLE_CUDASIM=1 the helpers in ``numeric`` switch to pure-Python equivalents so kernels
  run in the simulator on tiny shapes (CI); warp shuffles have a simulator fallback there too.
"""

import warnings as _warnings

# Grids here are sized to the work on purpose (a block per sequence in decode, one per layer's plan); numba's
# "fewer than 128 blocks" heuristic would warn once for every such launch shape a worker meets.
_warnings.filterwarnings("ignore", message=r"Grid size \d+ will likely result in GPU under-utilization")
