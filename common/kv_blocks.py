"""KV block arithmetic both services share: the router admits requests by the blocks they need, the worker's pool
allocates them, and the two must agree to the block."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks of `block_size` tokens that hold `num_tokens` tokens (the last one may be partly filled)."""
    return -(-num_tokens // block_size)
