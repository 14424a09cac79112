"""Turn an OpenAI request body into a :class:`RoutingRequest` the way the engine will see it.

Owns the router's tokenizers (one per model directory, loaded lazily with
``kvserve.model.tokenizer.Tokenizer``; no torch) and the body -> prompt rules, which must
stay in step with ``kvserve serve`` (kvserve.server.serving): completions: ``prompt`` as text
-> ``encode(text)``, as token ids -> as is (a batch of prompts routes by its first); chat:
``encode(apply_chat_template(messages, add_generation_prompt))`` without a second BOS. When
no tokenizer is available the raw text is kept, so the routing history (approximate prefix)
still works and precise prefix scores 0.
"""

from __future__ import annotations

import logging
from array import array
from typing import Any

import msgspec

from kvserve.cluster.routing_request import RoutingRequest
from kvserve.engine.hashing import DEFAULT_PREFIX_HASH_SEED

logger = logging.getLogger(__name__)


class BadRequestError(ValueError):
    """The request body cannot be routed (400)."""


class TokenizerRegistry:
    """Model name -> tokenizer, from a per-model directory map or one default directory."""

    def __init__(self, default_dir: str | None = None, by_model: dict[str, str] | None = None):
        self.default_dir = default_dir
        self.by_model = dict(by_model or {})
        self._loaded: dict[str, Any] = {}  # directory -> Tokenizer or None (failed)

    def get(self, model: str | None) -> Any | None:
        path = self.by_model.get(model or "", self.default_dir)
        if not path:
            return None
        if path not in self._loaded:
            try:
                from kvserve.model.tokenizer import Tokenizer

                self._loaded[path] = Tokenizer(path)
            except Exception as e:  # missing module, files, bad template: route without it
                logger.error(
                    "cannot load tokenizer from %s (%s): precise prefix scoring is "
                    "off for this model",
                    path,
                    e,
                )
                self._loaded[path] = None
        return self._loaded[path]


def _token_array(x: Any) -> array | None:
    """A prompt given as token ids, as a uint32 array (the form the block hasher reads).

    ``None`` when ``x`` is not a list of ints. Converted in C: a 32k-token prompt must not
    cost milliseconds, and the array is then hashed without another conversion.
    """
    if not isinstance(x, list) or not x or type(x[0]) is not int:
        return None
    try:
        return array("I", x)  # every item an int (bools count: the server rejects what it must)
    except TypeError:
        return None
    except OverflowError:
        raise BadRequestError("prompt token ids must be in [0, 2**32)") from None


def chat_prompt_ids(tok: Any, messages: list[Any], add_generation_prompt: bool) -> list[int]:
    """The prompt token ids of a chat request, exactly as ``kvserve serve`` builds them."""
    return tok.encode_chat(messages, add_generation_prompt=add_generation_prompt)


def routing_request(
    body: dict[str, Any],
    chat: bool,
    tokenizers: TokenizerRegistry,
    *,
    session_id: str | None = None,
    seed: str = DEFAULT_PREFIX_HASH_SEED,
) -> RoutingRequest:
    """Build the routing view of a request body (may tokenize: run long ones off-loop)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequestError("`model` must be a string")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequestError("`cache_salt` must be a string")
    req = RoutingRequest(model=model, cache_salt=salt or None, session_id=session_id, seed=seed)
    tok = tokenizers.get(model)
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequestError("`messages` must be a non-empty list")
        if tok is not None:
            try:
                req.token_ids = chat_prompt_ids(
                    tok, messages, bool(body.get("add_generation_prompt", True))
                )
                return req
            except Exception as e:  # the server will report the real error
                logger.debug("chat template failed, routing on raw text: %s", e)
        req.text = msgspec.json.encode(messages)
        return req
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and type(prompt[0]) is not int:
        prompt = prompt[0]  # a batch of prompts: route by the first
    ids = _token_array(prompt)
    if ids is not None:
        req.token_ids = ids
    elif isinstance(prompt, str):
        if tok is not None:
            try:
                req.token_ids = tok.encode(prompt)
                return req
            except Exception as e:
                logger.debug("tokenization failed, routing on raw text: %s", e)
        req.text = prompt.encode("utf-8", "surrogatepass")
    else:
        raise BadRequestError("`prompt` must be a string, a list of strings or token ids")
    return req


def prompt_chars(body: dict[str, Any], chat: bool) -> int:
    """Rough size of the text to tokenize, to decide whether to leave the event loop."""
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return 0
        return sum(
            len(m.get("content") or "") if isinstance(m.get("content"), str) else 256
            for m in msgs
            if isinstance(m, dict)
        )
    p = body.get("prompt")
    return len(p) if isinstance(p, str) else 0
