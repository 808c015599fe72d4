"""KV cache sizes: what a request reserves, in the units the caches really allocate."""

from __future__ import annotations

KV_STEP = 256  # mlx-lm's KVCache grows in steps of this many positions


def round_up(positions: int) -> int:
    return -(-positions // KV_STEP) * KV_STEP


def reservation_bytes(prompt_len: int, max_tokens: int, bytes_per_token: int) -> int:
    """The most a request's caches can hold: every prompt and generated position, rounded to KV_STEP."""
    return round_up(prompt_len + max_tokens) * bytes_per_token
