"""Numpy implementations of the decoder's layers: the CPU backend and the reference the CUDA kernels
are tested against. Shape legend: T tokens of the step, D hidden, H query heads, Hkv kv heads,
Hd head dim, E experts, K experts per token, F expert FFN size, V vocabulary."""
