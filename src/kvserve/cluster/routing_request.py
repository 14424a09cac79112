"""What the scheduler knows about one request: model, prompt tokens (or text), session.

Owns the memoized block keys of the prompt, per block size (endpoints usually share one, so
a prompt is hashed once per request; chunks shared with recent prompts not even once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.cluster.prompt_keys import PromptKeyCache, text_block_keys
from kvserve.engine.hashing import DEFAULT_PREFIX_HASH_SEED

# The process's memo of hashed prompt chunks (shared prefixes are hashed once).
PROMPT_KEYS = PromptKeyCache()


@dataclass
class RoutingRequest:
    model: str | None = None
    token_ids: Sequence[int] | None = None  # the prompt as the engine will see it
    text: bytes | None = None  # raw prompt bytes when it could not be tokenized
    cache_salt: str | None = None
    session_id: str | None = None
    seed: str = DEFAULT_PREFIX_HASH_SEED
    # Why the request must not be split between a prefill and a decode endpoint (the client
    # orchestrates P/D itself, n > 1, a batch of prompts), else None.
    pd_skip: str | None = None
    # Prompt tokens each scored endpoint holds, as the prefix scorers found (P/D reads it).
    held_tokens: dict[str, int] = field(default_factory=dict, repr=False)
    _keys: dict[int, list[int]] = field(default_factory=dict, repr=False)
    _text_keys: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def block_keys(self, block_size: int) -> list[int]:
        """Index keys of the prompt's cacheable blocks (empty when there are no tokens)."""
        keys = self._keys.get(block_size)
        if keys is None:
            if self.token_ids is None:
                keys = []
            else:
                keys = PROMPT_KEYS.block_keys(
                    self.token_ids, block_size, seed=self.seed, cache_salt=self.cache_salt
                )
            self._keys[block_size] = keys
        return keys

    def history_keys(self, block_size: int) -> list[int]:
        """Keys for the routing history: token blocks, else raw text chunks."""
        if self.token_ids is not None:
            return self.block_keys(block_size)
        keys = self._text_keys.get(block_size)
        if keys is None:
            data = self.text or b""
            if self.cache_salt:
                data = self.cache_salt.encode("utf-8") + b"\x00" + data
            # ~4 bytes of text per token: chunks about as long as a block of tokens.
            keys = text_block_keys(data, 4 * block_size, seed=self.seed)
            self._text_keys[block_size] = keys
        return keys
