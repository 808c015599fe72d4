"""KV cache sizes: what a request reserves, in the units the caches really allocate."""

from __future__ import annotations

KV_STEP = 256  # positions per KV block (PagedKV) at the default prefill step, which sets the block size


def round_up(positions: int, block: int = KV_STEP) -> int:
    return -(-positions // block) * block


def reservation_bytes(prompt_len: int, max_tokens: int, bytes_per_token: int, block: int = KV_STEP) -> int:
    """The most a request's caches can hold: every prompt and generated position, in whole blocks."""
    return round_up(prompt_len + max_tokens, block) * bytes_per_token
