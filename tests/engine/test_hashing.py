"""The block hash chain: layout fixed by shared/DESIGN.md, computed independently here."""

import hashlib
import struct
import subprocess
import sys

import cbor2
from hypothesis import given
from hypothesis import strategies as st

from kvserve.engine.hashing import (
    BlockHasher,
    block_extra_keys,
    hash_block_tokens,
    hash_to_int,
    salt_digest,
    seed_hash,
)


def _salt_key(salt: str) -> str:
    """Block 0's extra key of a salted request, as engine/hashing.py's docstring fixes it."""
    digest = hashlib.sha256(b"kvserve/cache_salt/v1\x00" + salt.encode()).hexdigest()
    return "salt-sha256:" + digest


def _reference(tokens, block_size, seed="kvserve", salt=None):
    parent = hashlib.sha256(seed.encode()).digest()
    out = []
    for i in range(len(tokens) // block_size):
        blk = tokens[i * block_size : (i + 1) * block_size]
        data = parent + struct.pack(f"<{block_size}I", *blk)
        if salt is not None and i == 0:
            data += cbor2.dumps([_salt_key(salt)])
        parent = hashlib.sha256(data).digest()
        out.append(parent)
    return out


def test_matches_spec_layout():
    toks = list(range(100, 150))
    assert hash_block_tokens(toks, 16) == _reference(toks, 16)
    assert len(hash_block_tokens(toks, 16)) == 3  # the partial block is not hashed


def test_seed_and_salt_change_every_hash():
    toks = list(range(64))
    base = hash_block_tokens(toks, 16)
    seeded = hash_block_tokens(toks, 16, seed="other")
    salted = hash_block_tokens(toks, 16, cache_salt="tenant-a")
    assert salted == _reference(toks, 16, salt="tenant-a")
    assert not set(base) & set(seeded)
    assert not set(base) & set(salted)


def test_salt_enters_the_chain_only_as_its_digest():
    salt = "tenant-secret-7"
    assert salt_digest(salt) == _salt_key(salt)
    assert block_extra_keys(0, salt) == [_salt_key(salt)]
    assert block_extra_keys(1, salt) is None
    assert block_extra_keys(0, salt, "lora") == [_salt_key(salt), "lora"]
    assert salt not in salt_digest(salt) and salt_digest(salt) != salt_digest(salt + "x")
    assert salt_digest("a\ud800b").startswith("salt-sha256:")  # lone surrogate: no crash
    toks = list(range(32))
    assert hash_block_tokens(toks, 16, cache_salt=salt) == _reference(toks, 16, salt=salt)
    # A salt equal to another salt's digest is a different tenant.
    forged = hash_block_tokens(toks, 16, cache_salt=salt_digest(salt))
    assert not set(forged) & set(hash_block_tokens(toks, 16, cache_salt=salt))


def test_hash_to_int_is_last_eight_bytes_big_endian():
    h = bytes(range(32))
    assert hash_to_int(h) == int.from_bytes(bytes(range(24, 32)), "big")
    assert seed_hash() == hashlib.sha256(b"kvserve").digest()


@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.sampled_from([1, 4, 16]))
def test_incremental_equals_one_shot(tokens, block_size):
    hasher = BlockHasher(block_size)
    for i in range(0, len(tokens) + 1, 7):
        hasher.update(tokens[:i])
    hasher.update(tokens)
    assert hasher.hashes == hash_block_tokens(tokens, block_size)


def test_importable_without_torch():
    code = (
        "import sys; import kvserve.engine.hashing, kvserve.kv.events; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
