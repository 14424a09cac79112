"""Turn an OpenAI request body into a :class:`RoutingRequest` the way the engine will see it.

Owns the router's tokenizers (one per model directory, loaded lazily with
``kvserve.model.tokenizer.Tokenizer``; no torch) and the body -> prompt rules, which must
stay in step with ``kvserve serve`` (kvserve.server.serving): completions: ``prompt`` as text
-> ``encode(text)``, as token ids -> as is (a batch of prompts routes by its first); chat:
``encode(apply_chat_template(messages, add_generation_prompt))`` without a second BOS. When
no tokenizer is available the raw text is kept, so the routing history (approximate prefix)
still works and precise prefix scores 0.

Prefix scoring needs only a prompt's first blocks: a prompt is tokenized up to
``max_tokens`` (what the largest endpoint context could hold) and no further, so a text far
longer than any context costs no more than one that fits (the engine rejects it anyway).
Long texts are encoded a chunk of ``CHUNK_CHARS`` at a time, each chunk cut just before a
space that follows a non-space character: ``tokenizers`` holds the GIL for a whole
``encode`` call, and between chunks the router's event loop gets it back.

Exactness: byte-level BPE tokenizers split text with a regex before merging, and the
GPT-2 / Llama 3 / Qwen 2 patterns never put a space after a non-space character into one
piece (a space only starts a piece), so the pieces before such a cut are the same with or
without the text after it, and the tokens of the chunks, concatenated, are the tokens of the
text. This is checked once per tokenizer on sample text; a tokenizer that fails the check
(e.g. SentencePiece-style ones that add a prefix space to every encoded string) encodes one
growing prefix instead, still capped, and then only its last word may differ. A chunk
without such a space in its second half (a run of 4,000+ characters without one) is cut
where it ends: its last piece may then tokenize differently, which can only cost a prefix
hit, never correctness (the engine tokenizes the request itself).
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec

from kvserve.cluster.routing_request import RoutingRequest
from kvserve.engine.hashing import DEFAULT_PREFIX_HASH_SEED

logger = logging.getLogger(__name__)

CHUNK_CHARS = 8192  # text encoded per tokenizer call in long prompts (~5-10 ms on one core)
DEFAULT_MAX_TOKENS = 131072  # tokens computed per prompt when no endpoint reports its context
_SPLIT_SAMPLES = (
    "The quick brown fox, 42 times; don't stop!  Then\tagain:\n\nnew-line 3.14 end.",
    "def f(x):\n    return x ** 2  # comment\n\n\nclass A:  pass   \u00e9t\u00e9 \u4e2d\u6587 ok",
)
T = TypeVar("T")


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


class TokenizerWorkers:
    """Threads that tokenize long prompts off the event loop, with a bound on the work
    waiting for them: :meth:`submit` refuses (``None``) beyond ``max_pending`` jobs, and the
    request is then routed on its raw text (less precise, never blocked)."""

    def __init__(self, threads: int = 2, max_pending: int = 64) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvserve-tokenize")
        self.max_pending = max_pending
        self._pending = 0
        self._lock = threading.Lock()
        self.refused = 0

    def submit(self, fn: Callable[[], T]) -> Future[T] | None:
        with self._lock:
            if self._pending >= self.max_pending:
                self.refused += 1
                return None
            self._pending += 1
        fut = self._pool.submit(fn)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, _: Future) -> None:
        with self._lock:
            self._pending -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class PrefixEncoder:
    """``encode`` of a tokenizer that stops after ``max_tokens`` tokens, a chunk at a time
    (see the module doc for what is exact). Everything else is the tokenizer's own, so
    ``Tokenizer.encode_chat`` run on it applies the one chat rule shared with the server.

    A text encoded in chunks comes back as a uint32 ``array``, filled a chunk at a time: its
    ids never exist as 100k+ Python ints at once (4 MiB of small objects, whose allocator
    arenas other objects made in the meantime keep from being returned to the OS)."""

    _splits: dict[int, tuple[bool, list[int], list[int]]] = {}  # id(tok) -> probe results
    _splits_lock = threading.Lock()

    def __init__(self, tok: Any, max_tokens: int, chunk_chars: int = CHUNK_CHARS) -> None:
        self._tok = tok
        self.max_tokens = max_tokens
        self.chunk_chars = chunk_chars
        self.truncated = False  # the text was longer than what was encoded

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> Sequence[int]:
        tok = self._tok
        if len(text) <= self.chunk_chars:
            ids = tok.encode(text, add_special_tokens=add_special_tokens)
            if len(ids) > self.max_tokens:
                self.truncated = True
                return ids[: self.max_tokens]
            return ids
        clean, prefix, suffix = self._probe(tok)
        ids = array("I", prefix if add_special_tokens else [])
        pos, n = 0, len(text)
        if clean:
            while pos < n and len(ids) < self.max_tokens:
                end = _cut(text, pos, self.chunk_chars)
                ids.extend(tok.encode(text[pos:end], add_special_tokens=False))
                pos = end
        else:  # one growing prefix, doubling until it holds enough tokens
            size = self.chunk_chars
            while True:
                pos = _cut(text, 0, size)
                ids = tok.encode(text[:pos], add_special_tokens=add_special_tokens)
                if pos >= n or len(ids) >= self.max_tokens:
                    break
                size *= 2
            if pos < n:
                ids = ids[: len(ids) - len(suffix)] if add_special_tokens and suffix else ids
        if pos < n:
            self.truncated = True
            return ids[: self.max_tokens]
        if add_special_tokens and clean:
            ids.extend(suffix)
        return ids

    @classmethod
    def _probe(cls, tok: Any) -> tuple[bool, list[int], list[int]]:
        """Whether cuts before a space keep tokens exact, and the special tokens the
        tokenizer adds before and after a sequence."""
        key = id(tok)
        found = cls._splits.get(key)
        if found is None:
            clean = True
            for sample in _SPLIT_SAMPLES:  # every cut the chunking may make
                whole = tok.encode(sample, add_special_tokens=False)
                for i in range(1, len(sample)):
                    if sample[i] == " " and not sample[i - 1].isspace():
                        head = tok.encode(sample[:i], add_special_tokens=False)
                        tail = tok.encode(sample[i:], add_special_tokens=False)
                        clean = clean and head + tail == whole
            plain = tok.encode("a", add_special_tokens=False)
            full = tok.encode("a", add_special_tokens=True)
            at = next((i for i in range(len(full)) if full[i : i + len(plain)] == plain), len(full))
            found = (clean, full[:at], full[at + len(plain) :])
            with cls._splits_lock:
                cls._splits[key] = found
        return found


def _cut(text: str, start: int, size: int) -> int:
    """End of the chunk of ``text`` from ``start``: just before the last space in
    ``[start + size // 2, start + size)`` that follows a non-space, else ``start + size``."""
    end = start + size
    if end >= len(text):
        return len(text)
    lo = start + size // 2
    i = text.rfind(" ", lo, end)
    while i >= lo and text[i - 1].isspace():
        i = text.rfind(" ", lo, i)
    return i if i >= lo else end


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


def chat_prompt_ids(
    tok: Any, messages: list[Any], add_generation_prompt: bool, max_tokens: int | None = None
) -> Sequence[int]:
    """The prompt token ids of a chat request, exactly as ``kvserve serve`` builds them
    (the first ``max_tokens`` of them, when given)."""
    if max_tokens is None:
        return tok.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    # The tokenizer's own chat rule, with an encode that stops after max_tokens.
    return type(tok).encode_chat(
        PrefixEncoder(tok, max_tokens), messages, add_generation_prompt=add_generation_prompt
    )


def routing_request(
    body: dict[str, Any],
    chat: bool,
    tokenizers: TokenizerRegistry | None,
    *,
    session_id: str | None = None,
    seed: str = DEFAULT_PREFIX_HASH_SEED,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> RoutingRequest:
    """Build the routing view of a request body: its first ``max_tokens`` prompt tokens
    (may tokenize: run long ones off-loop). ``tokenizers=None``: route on the raw text."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequestError("`model` must be a string")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise BadRequestError("`cache_salt` must be a string")
    req = RoutingRequest(model=model, cache_salt=salt or None, session_id=session_id, seed=seed)
    tok = tokenizers.get(model) if tokenizers is not None else None
    max_text = 4 * max_tokens  # raw-text routing keys ~4 bytes a token (history_keys)
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequestError("`messages` must be a non-empty list")
        if tok is not None:
            try:
                req.token_ids = chat_prompt_ids(
                    tok, messages, bool(body.get("add_generation_prompt", True)), max_tokens
                )
                return req
            except Exception as e:  # the server will report the real error
                logger.debug("chat template failed, routing on raw text: %s", e)
        try:
            req.text = msgspec.json.encode(messages)[:max_text]
        except (TypeError, RecursionError):  # the server will report it
            req.text = b""
        return req
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and type(prompt[0]) is not int:
        prompt = prompt[0]  # a batch of prompts: route by the first
    if isinstance(prompt, list) and len(prompt) > max_tokens:
        prompt = prompt[:max_tokens]
    ids = _token_array(prompt)
    if ids is not None:
        req.token_ids = ids
    elif isinstance(prompt, str):
        if tok is not None:
            try:
                req.token_ids = PrefixEncoder(tok, max_tokens).encode(prompt)
                return req
            except Exception as e:
                logger.debug("tokenization failed, routing on raw text: %s", e)
        req.text = prompt[:max_text].encode("utf-8", "surrogatepass")
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
