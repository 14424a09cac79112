"""The router's memo of prompt chunk keys gives exactly what hashing the prompt gives."""

from __future__ import annotations

import random
from array import array

import pytest

from kvserve.cluster.prompt_keys import PromptKeyCache, prompt_block_keys
from kvserve.cluster.tokenization import BadRequestError, TokenizerRegistry, routing_request
from kvserve.engine.hashing import hash_to_int, salt_digest
from kvserve.engine.request import Request
from kvserve.engine.sampling_params import SamplingParams


def test_prompt_key_cache_matches_hashing_with_shared_prefixes() -> None:
    rng = random.Random(0)
    cache = PromptKeyCache(chunk_blocks=3, max_chunks=64)
    systems = [[rng.randrange(50) for _ in range(rng.randrange(0, 120))] for _ in range(4)]
    for i in range(600):
        bs = rng.choice([1, 4, 16])
        prompt = rng.choice(systems) + [rng.randrange(50) for _ in range(rng.randrange(0, 60))]
        seed = rng.choice(["kvserve", "other"])
        ids = array("I", prompt) if i % 2 else prompt
        want = prompt_block_keys(prompt, bs, seed=seed)
        assert cache.block_keys(ids, bs, seed=seed) == want
        assert cache.block_keys(ids, bs, seed=seed) == want  # now from the memo
        salted = prompt_block_keys(prompt, bs, seed=seed, cache_salt="t")
        assert cache.block_keys(ids, bs, seed=seed, cache_salt="t") == salted
        if len(prompt) > bs:
            assert salted[0] != want[0]
    assert cache.hits > 600 and cache.misses > 0
    assert len(cache) <= 64  # bounded


def test_salted_router_keys_are_the_engines_block_hashes() -> None:
    """The router digests a request's salt as the engine does: its keys for a salted prompt
    are the engine's own block hashes (same seed), and the salt's digest differs per salt."""
    prompt = list(range(100, 165))
    for salt in ("tenant-a", "tenant-b", "a\ud800b"):
        req = Request("r", prompt, SamplingParams(), block_size=16, cache_salt=salt)
        keys = prompt_block_keys(prompt + [0], 16, cache_salt=salt)
        assert keys == [hash_to_int(h) for h in req.block_hashes]
    assert salt_digest("tenant-a") != salt_digest("tenant-b")
    assert prompt_block_keys(prompt, 16, cache_salt="tenant-a") != prompt_block_keys(
        prompt, 16, cache_salt="tenant-b"
    )


def test_token_id_prompts_are_checked_once_in_c() -> None:
    toks = TokenizerRegistry()
    req = routing_request({"prompt": [1, 2, 3]}, False, toks)
    assert list(req.token_ids) == [1, 2, 3]
    with pytest.raises(BadRequestError):
        routing_request({"prompt": [1, -2, 3]}, False, toks)  # not a token id
    with pytest.raises(BadRequestError):
        routing_request({"prompt": [1, "a"]}, False, toks)
