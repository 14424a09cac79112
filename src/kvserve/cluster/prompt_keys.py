"""Block keys of a prompt as the router's KV index sees them.

Owns the one rule the router applies before matching a prompt against the index: hash
with :mod:`kvserve.engine.hashing` (the router's seed, the endpoint's block size) only the
blocks an engine could serve from cache, i.e. the full blocks of ``prompt[:-1]``: the last
prompt token is always computed, so a prompt of exactly k blocks can hit at most k - 1.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvserve.engine.hashing import DEFAULT_PREFIX_HASH_SEED, hash_block_tokens, seed_hash


def cacheable_tokens(token_ids: Sequence[int]) -> Sequence[int]:
    """The prompt tokens whose KV may come from a cache (all but the last)."""
    return token_ids[:-1] if token_ids else token_ids


def prompt_block_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    seed: str = DEFAULT_PREFIX_HASH_SEED,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> list[int]:
    """Index keys (64-bit ints) of the cacheable full blocks of a prompt, in order."""
    tokens = cacheable_tokens(token_ids)
    if len(tokens) < block_size:
        return []
    hashes = hash_block_tokens(
        tokens, block_size, seed=seed, cache_salt=cache_salt, lora_name=lora_name
    )
    frm = int.from_bytes
    return [frm(h[-8:], "big") for h in hashes]


def text_block_keys(
    data: bytes, chunk_bytes: int, *, seed: str = DEFAULT_PREFIX_HASH_SEED
) -> list[int]:
    """Chained keys of the full ``chunk_bytes`` chunks of raw prompt bytes.

    Used only by the routing history when a prompt cannot be tokenized: two prompts with the
    same leading text share leading keys, which is all the approximate prefix scorer needs.
    """
    parent = seed_hash(seed)
    out: list[int] = []
    frm = int.from_bytes
    sha = hashlib.sha256
    for i in range(len(data) // chunk_bytes):
        h = sha(parent)
        h.update(data[i * chunk_bytes : (i + 1) * chunk_bytes])
        parent = h.digest()
        out.append(frm(parent[-8:], "big"))
    return out
