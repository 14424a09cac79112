"""Block hash chain: the one definition of a KV block's identity.

Owned here and imported by the engine (prefix cache), the KV tiers (offload keys) and the
router (index keys). Must stay importable without torch.

Hash of block i = SHA-256(parent || tokens || extra) where
- parent is the 32-byte hash of block i-1, or for block 0 SHA-256 of the prefix-hash seed;
- tokens are the block's token ids as little-endian uint32;
- extra, present only when the block has extra keys (the tenant's salt digest on block 0,
  LoRA name, ...), is the CBOR encoding of the list of keys.
Only full blocks are hashed. Events and indexes use :func:`hash_to_int` (last 8 bytes, BE).

A tenant's ``cache_salt`` never enters the chain (nor the KV events that carry the extra keys)
in clear: block 0's extra key is :func:`salt_digest` of it, a fixed-format, domain-separated
SHA-256 string that the router computes the same way from a request's salt.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from functools import lru_cache

import cbor2

DEFAULT_PREFIX_HASH_SEED = "kvserve"
HASH_BYTES = 32
# Block 0's extra key of a salted request: this prefix, then 64 hex digits.
SALT_DIGEST_PREFIX = "salt-sha256:"
_SALT_DOMAIN = b"kvserve/cache_salt/v1\x00"

BlockHash = bytes


@lru_cache(maxsize=64)
def seed_hash(seed: str = DEFAULT_PREFIX_HASH_SEED) -> BlockHash:
    """The virtual parent of block 0."""
    return hashlib.sha256(seed.encode("utf-8")).digest()


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    """All tokens as little-endian uint32, encoded once so callers can slice per block."""
    arr = array("I", token_ids)
    if arr.itemsize != 4:  # pragma: no cover - exotic platforms
        arr = array("L", token_ids)
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def hash_block(
    parent: BlockHash, token_bytes: bytes, extra_keys: Sequence | None = None
) -> BlockHash:
    """Hash one full block given its parent hash and its tokens' uint32 LE bytes."""
    h = hashlib.sha256(parent)
    h.update(token_bytes)
    if extra_keys:
        h.update(cbor2.dumps(list(extra_keys)))
    return h.digest()


@lru_cache(maxsize=4096)
def salt_digest(cache_salt: str) -> str:
    """The form of a tenant's ``cache_salt`` that is hashed and published: one-way, so KV
    events and tier keys never reveal the salt, and the same in every process (no seed).

    ``"salt-sha256:" + hex(SHA-256("kvserve/cache_salt/v1" NUL || UTF-8 salt))``; lone
    surrogates (valid in JSON strings) are encoded as themselves rather than rejected.
    """
    data = cache_salt.encode("utf-8", "surrogatepass")
    return SALT_DIGEST_PREFIX + hashlib.sha256(_SALT_DOMAIN + data).hexdigest()


def block_extra_keys(
    block_index: int, cache_salt: str | None = None, lora_name: str | None = None
) -> list | None:
    """Extra keys of one block: the tenant salt's digest on block 0, the LoRA name on every
    block. ``cache_salt`` is the raw salt (it is digested here)."""
    keys: list = []
    if block_index == 0 and cache_salt:
        keys.append(salt_digest(cache_salt))
    if lora_name:
        keys.append(lora_name)
    return keys or None


def hash_block_tokens(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: BlockHash | None = None,
    seed: str = DEFAULT_PREFIX_HASH_SEED,
    start_block: int = 0,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids``.

    ``token_ids`` starts at block ``start_block`` of the sequence, and ``parent`` is the hash
    of block ``start_block - 1`` (ignored for ``start_block == 0``, where the seed is used).
    A trailing partial block is not hashed.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    if start_block == 0 or parent is None:
        if start_block != 0:
            raise ValueError("parent is required when start_block > 0")
        parent = seed_hash(seed)
    data = encode_tokens(token_ids)
    stride = 4 * block_size
    n_full = len(token_ids) // block_size
    out: list[BlockHash] = []
    if cache_salt or lora_name:
        for i in range(n_full):
            extra = block_extra_keys(start_block + i, cache_salt, lora_name)
            parent = hash_block(parent, data[i * stride : (i + 1) * stride], extra)
            out.append(parent)
        return out
    return hash_encoded_blocks(parent, data[: n_full * stride], stride)


def hash_encoded_blocks(parent: BlockHash, data: bytes, stride: int) -> list[BlockHash]:
    """Chained hashes of the ``stride``-byte blocks of already encoded tokens (no extra keys).

    The hot path: the router hashes every prompt through here.
    """
    sha = hashlib.sha256
    out: list[BlockHash] = []
    append = out.append
    for i in range(0, len(data) - stride + 1, stride):
        parent = sha(parent + data[i : i + stride]).digest()
        append(parent)
    return out


def hash_to_int(block_hash: BlockHash) -> int:
    """The 64-bit integer form used by KV events and the router's index (last 8 bytes, BE)."""
    return int.from_bytes(block_hash[-8:], "big")


class BlockHasher:
    """Incremental hasher for one growing sequence (prompt, then generated tokens)."""

    __slots__ = ("block_size", "seed", "cache_salt", "lora_name", "hashes")

    def __init__(
        self,
        block_size: int,
        seed: str = DEFAULT_PREFIX_HASH_SEED,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        self.block_size = block_size
        self.seed = seed
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.hashes: list[BlockHash] = []

    def update(self, all_token_ids: Sequence[int]) -> list[BlockHash]:
        """Extend ``hashes`` to cover every full block of ``all_token_ids``; return new ones."""
        done = len(self.hashes)
        n_full = len(all_token_ids) // self.block_size
        if n_full <= done:
            return []
        new = hash_block_tokens(
            all_token_ids[done * self.block_size : n_full * self.block_size],
            self.block_size,
            parent=self.hashes[-1] if done else None,
            seed=self.seed,
            start_block=done,
            cache_salt=self.cache_salt,
            lora_name=self.lora_name,
        )
        self.hashes.extend(new)
        return new
