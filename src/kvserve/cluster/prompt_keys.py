"""Block keys of a prompt as the router's KV index sees them.

Owns the one rule the router applies before matching a prompt against the index: hash
with :mod:`kvserve.engine.hashing` (the router's seed, the endpoint's block size) only the
blocks an engine could serve from cache, i.e. the full blocks of ``prompt[:-1]``: the last
prompt token is always computed, so a prompt of exactly k blocks can hit at most k - 1.
A request's ``cache_salt`` enters as it does on the engine: as ``salt_digest(salt)`` on
block 0 (:mod:`kvserve.engine.hashing`; the form KV events carry), so salted prefixes match.

Also owns :class:`PromptKeyCache`, the router's memo of recently hashed prompt chunks:
prompts that reach a router mostly share long prefixes (system prompts, earlier turns of a
conversation), and one dict probe per chunk of 16 blocks is much cheaper than 16 SHA-256s.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvserve.engine.hashing import (
    DEFAULT_PREFIX_HASH_SEED,
    encode_tokens,
    hash_block_tokens,
    hash_encoded_blocks,
    seed_hash,
)


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
    return hash_keys(hashes)


def hash_keys(hashes: list[bytes]) -> list[int]:
    """``hash_to_int`` of every 32-byte hash (last 8 bytes, big endian), in one C call."""
    return list(struct.unpack(f">{4 * len(hashes)}Q", b"".join(hashes))[3::4])


class PromptKeyCache:
    """Memo of prompt chunks: (block size, parent hash, chunk's token bytes) -> block keys.

    A prompt is split into chunks of ``chunk_blocks`` full blocks (the last may be shorter);
    a chunk is identified by its tokens and its parent hash (which covers every token
    before it and the seed), so a hit returns exactly what hashing would. Bounded LRU of
    ``max_chunks`` entries (about 1.5 KiB each at 16-token blocks); thread-safe (long prompts
    are hashed on worker threads). Salted and LoRA prompts are not cached.
    """

    def __init__(self, chunk_blocks: int = 16, max_chunks: int = 8192) -> None:
        if chunk_blocks < 1 or max_chunks < 1:
            raise ValueError("chunk_blocks and max_chunks must be >= 1")
        self.chunk_blocks = chunk_blocks
        self.max_chunks = max_chunks
        self._memo: OrderedDict[tuple[int, bytes, bytes], tuple[bytes, list[int]]]
        self._memo = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._memo)

    def block_keys(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        seed: str = DEFAULT_PREFIX_HASH_SEED,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> list[int]:
        """Same result as :func:`prompt_block_keys`."""
        if cache_salt or lora_name:
            return prompt_block_keys(
                token_ids, block_size, seed=seed, cache_salt=cache_salt, lora_name=lora_name
            )
        n_full = (len(token_ids) - 1) // block_size  # cacheable: all but the last token
        if n_full <= 0:
            return []
        data = encode_tokens(token_ids)
        block_bytes = 4 * block_size
        stride = block_bytes * self.chunk_blocks
        end = block_bytes * n_full
        parent = seed_hash(seed)
        keys: list[int] = []
        memo, lock = self._memo, self._lock
        for off in range(0, end, stride):
            chunk = data[off : min(off + stride, end)]
            memo_key = (block_size, parent, chunk)
            with lock:
                hit = memo.get(memo_key)
                if hit is not None:
                    memo.move_to_end(memo_key)
                    self.hits += 1
            if hit is None:
                hashes = hash_encoded_blocks(parent, chunk, block_bytes)
                hit = (hashes[-1], hash_keys(hashes))
                with lock:
                    memo[memo_key] = hit
                    self.misses += 1
                    if len(memo) > self.max_chunks:
                        memo.popitem(last=False)
            parent = hit[0]
            keys += hit[1]
        return keys


def text_block_keys(
    data: bytes, chunk_bytes: int, *, seed: str = DEFAULT_PREFIX_HASH_SEED
) -> list[int]:
    """Chained keys of the full ``chunk_bytes`` chunks of raw prompt bytes.

    Used only by the routing history when a prompt cannot be tokenized: two prompts with the
    same leading text share leading keys, which is all the approximate prefix scorer needs.
    """
    return hash_keys(hash_encoded_blocks(seed_hash(seed), data, chunk_bytes))
