"""The cuda backend: device weights uploaded from pinned mmaps, a memory plan allocated once, the
decoder that launches the kernels of expert_service/kernels, and CUDA graphs for decode steps."""
