"""Tokenization jobs, and the worker process that runs them away from the server's event loop.

A job turns a completions prompt or a chat conversation into token ids within two bounds: a
text longer than ``max_chars`` is refused without tokenizing it, and a prompt of
``limit`` tokens or more comes back as its length only (the ids of a prompt that cannot run
are never shipped). :func:`run_job` runs inline for small inputs and in the worker for large
ones, so both paths give the same answer.

Why a process: the ``tokenizers`` binding holds the GIL for a whole ``encode`` (a 5 MB text
took ~4 s here with the loop frozen; a thread does not help), and chat templates are Python.

Worker protocol (``python -m kvserve.server.tokenizer_worker TOKENIZER_DIR``): on stdin and
stdout, frames of a 4-byte little-endian length and a msgpack array: ``[job_id, op, *args]``
in, ``[job_id, status, value]`` out, in order. The worker exits when stdin closes, so it never
outlives the server. This module imports no web framework and no torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
import sys
from typing import Any

import msgspec

_LEN = struct.Struct("<I")
# After a job over this many characters, return freed heap memory to the OS (malloc_trim).
TRIM_AFTER_CHARS = 1 << 18
# A text over 2 x PREFIX_FACTOR x limit characters is first judged by prefixes of
# PREFIX_FACTOR x limit characters, then 4x, 16x, ... (shorter than the text): if one alone is
# 2 x limit tokens or more, the whole is refused without tokenizing the rest. Cutting a text
# changes its tokenization only around the cut (a token never spans far across it), so a
# prefix with twice the context's tokens proves the whole cannot fit. Prose (~4 characters per
# token) is refused from the first prefix. A text tokenized whole has fewer than 2 x limit
# tokens in its first quarter, so the tokenizer's memory (it grows with tokens, ~1 KB each in
# the HF library's encodings) is bounded by the context rather than by the body size.
PREFIX_FACTOR = 16

# Job results: (status, value).
OK = "ok"  # value: token ids
TOO_LONG = "too_long"  # value: the prompt's length in tokens (>= limit)
TOO_LONG_PREFIX = "too_long_prefix"  # value: [tokens, characters] of a prefix (>= 2 x limit)
TOO_LONG_CHARS = "too_long_chars"  # value: the text's length in characters (> max_chars)
ERROR = "error"  # value: message (the chat template failed)

# Keys a chat template receives from the server itself; chat_template_kwargs cannot set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token"}
)


def encode_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None = None,
    max_chars: int | None = None,
    limit: int | None = None,
) -> tuple[str, Any]:
    """``tokenizer.encode_chat`` with template kwargs and bounds on the rendered text (in
    characters) and the prompt (in tokens: see :func:`encode_bounded`)."""
    from kvserve.model.tokenizer import chat_message_text

    msgs = []
    for m in messages:
        msg = {"role": m["role"], "content": chat_message_text(m.get("content"))}
        if m.get("name") is not None:
            msg["name"] = m["name"]
        msgs.append(msg)
    try:
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt, **(template_kwargs or {}))
    except Exception as exc:  # the template's raise_exception, jinja errors, bad kwargs
        return ERROR, str(exc)
    if max_chars is not None and len(text) > max_chars:
        return TOO_LONG_CHARS, len(text)
    # The same BOS rule as Tokenizer.encode_chat: a template that renders BOS gets no second.
    bos = tokenizer.bos_token
    return encode_bounded(tokenizer, text, limit, not (bos and text.startswith(bos)))


def encode_bounded(
    tokenizer: Any, text: str, limit: int | None, add_special_tokens: bool = True
) -> tuple[str, Any]:
    """``(OK, ids)``, or ``(TOO_LONG, n)`` when ``limit`` tokens or more, or
    ``(TOO_LONG_PREFIX, [n, k])`` when the first ``k`` characters alone are ``n`` >= 2 x limit
    tokens (see :data:`PREFIX_FACTOR`)."""
    if limit is not None:
        k = PREFIX_FACTOR * limit
        while k < len(text) and len(text) > 2 * PREFIX_FACTOR * limit:
            n = len(tokenizer.encode(text[:k], add_special_tokens=add_special_tokens))
            if n >= 2 * limit:
                return TOO_LONG_PREFIX, [n, k]
            k *= 4
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if limit is not None and len(ids) >= limit:
        return TOO_LONG, len(ids)
    return OK, ids


def run_job(tokenizer: Any, op: str, args: list[Any]) -> tuple[str, Any]:
    """One job: ``("encode", [text, max_chars, limit])`` or
    ``("chat", [messages, add_generation_prompt, template_kwargs, max_chars, limit])``."""
    if op == "encode":
        text, max_chars, limit = args
        if len(text) > max_chars:
            return TOO_LONG_CHARS, len(text)
        return encode_bounded(tokenizer, text, limit)
    if op == "chat":
        messages, add_generation_prompt, template_kwargs, max_chars, limit = args
        return encode_chat(
            tokenizer, messages, add_generation_prompt, template_kwargs, max_chars, limit
        )
    return ERROR, f"unknown job {op!r}"


def malloc_trim() -> None:
    """Give freed heap memory back to the OS (glibc; a no-op elsewhere). Releases the GIL."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        trim = None
    if trim is not None:
        trim(0)


def _read_exact(stream: Any, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frame(stream: Any) -> bytes | None:
    """One frame's payload, or None at end of stream."""
    head = _read_exact(stream, _LEN.size)
    if head is None:
        return None
    return _read_exact(stream, _LEN.unpack(head)[0])


def frame(payload: bytes) -> bytes:
    return _LEN.pack(len(payload)) + payload


def main(argv: list[str]) -> int:
    from kvserve.model.tokenizer import Tokenizer

    # Frames go to the real stdout; anything a library prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    tokenizer = Tokenizer(argv[0])
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    while (payload := read_frame(inp)) is not None:
        job_id, op, *args = decoder.decode(payload)
        del payload
        size = len(args[0]) if op == "encode" and args else 0
        if op == "chat" and args:
            size = sum(len(str(m.get("content") or "")) for m in args[0])
        try:
            status, value = run_job(tokenizer, op, args)
        except Exception as exc:  # never die on one job
            status, value = ERROR, f"{type(exc).__name__}: {exc}"
        del args
        out.write(frame(encoder.encode([job_id, status, value])))
        out.flush()
        del value
        if size >= TRIM_AFTER_CHARS:
            malloc_trim()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
