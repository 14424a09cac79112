"""What one request may ask of the engine server, checked before any tokenization or engine work.

Owns the amplification limits (configured in :class:`kvserve.config.ServerConfig`): ``n``,
sequences per request (prompts x ``n``), the length of a completions prompt list, stop
strings (count and total characters) and stop token ids, chat messages; and the character
bound that refuses a prompt whose text cannot fit ``max_model_len`` tokens without tokenizing
it. The checks read the decoded JSON before pydantic validates it, so that validation itself
(about 0.15 s per million token ids on a slow core) is bounded too: a value of the wrong type is
left to validation, which names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.config import ServerConfig
from kvserve.server.errors import APIError, bad_request

# How many code points of a prompt one token can stand for, at most, beyond the longest token
# in the vocabulary: tokenizers normalize before they split, and Unicode composition (NFC,
# NFKC) merges up to 3-4 code points into one (a Hangul syllable from 3 jamo, a letter with
# two combining marks); accent stripping removes one mark per letter. See max_prompt_chars.
NORMALIZATION_FACTOR = 4


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the longest token string in the vocabulary (added tokens included).

    Token strings as stored: byte-level BPE writes one character per byte (so this counts
    bytes, at least the characters they decode to), SentencePiece writes the text with '▁' for
    spaces, byte-fallback tokens ('<0xE4>') and WordPiece suffixes ('##ing') are longer than
    what they stand for. So no token covers more characters of normalized text than this.
    """
    tokens = tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size))
    return max((len(t) for t in tokens if t), default=1)


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """The most characters a prompt of fewer than ``max_model_len`` tokens can have.

    A longer text is refused with 400 before it is tokenized: ``max_model_len`` tokens of the
    longest token, times :data:`NORMALIZATION_FACTOR` for what normalization can merge or drop.
    For the tiny preset (longest token 37 characters, 2048 positions) that is 303,104
    characters, ~80x the ~4 characters per token of English prose; for a Llama 3 vocabulary at
    8k context, tens of MB, so the body limit binds first. Only text made mostly of characters
    the tokenizer deletes (a normalizer that strips them) could be refused wrongly.
    """
    return max_model_len * longest_token_chars(tokenizer) * NORMALIZATION_FACTOR


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 16
    max_request_body_bytes: int = 8 << 20
    max_seqs_per_request: int = 256
    max_prompts_per_request: int = 256
    max_stop_strings: int = 64
    max_stop_chars: int = 4096
    max_messages: int = 2048

    @classmethod
    def from_config(cls, config: ServerConfig) -> RequestLimits:
        return cls(
            max_n=config.max_n,
            max_request_body_bytes=config.max_request_body_bytes,
            max_seqs_per_request=config.max_seqs_per_request,
            max_prompts_per_request=config.max_prompts_per_request,
            max_stop_strings=config.max_stop_strings,
            max_stop_chars=config.max_stop_chars,
            max_messages=config.max_messages,
        )

    # -- body -----------------------------------------------------------------------------
    def body_too_large(self, size: int) -> APIError:
        return APIError(
            f"The request body has more than {self.max_request_body_bytes} bytes "
            f"(the server's --max-request-body-bytes); got {size}.",
            413,
            code="request_too_large",
            headers={"Connection": "close"},
        )

    # -- decoded JSON, before validation ---------------------------------------------------
    def check_completion(self, body: dict[str, Any], max_model_len: int) -> None:
        n = self._check_common(body)
        prompt = body.get("prompt")
        num_prompts = 1
        if isinstance(prompt, list) and prompt:
            if _is_int(prompt[0]):  # one prompt of token ids
                _check_ids_len(len(prompt), max_model_len)
            else:
                num_prompts = len(prompt)
                if num_prompts > self.max_prompts_per_request:
                    raise bad_request(
                        f"The prompt list has {num_prompts} prompts; at most "
                        f"{self.max_prompts_per_request} are allowed per request.",
                        "prompt",
                        "too_many_prompts",
                    )
                for item in prompt:
                    if isinstance(item, list):
                        _check_ids_len(len(item), max_model_len)
        self._check_seqs(num_prompts, n)

    def check_chat(self, body: dict[str, Any]) -> None:
        n = self._check_common(body)
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > self.max_messages:
            raise bad_request(
                f"The request has {len(messages)} messages; at most {self.max_messages} are "
                "allowed.",
                "messages",
                "too_many_messages",
            )
        self._check_seqs(1, n)

    def _check_common(self, body: dict[str, Any]) -> int:
        n = body.get("n")
        n = n if _is_int(n) else 1
        if n > self.max_n:
            raise bad_request(f"n must be at most {self.max_n}, got {n}", "n")
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        if len(stops) > self.max_stop_strings:
            raise bad_request(
                f"The request has {len(stops)} stop strings; at most {self.max_stop_strings} are "
                "allowed.",
                "stop",
                "too_many_stop_strings",
            )
        chars = sum(len(s) for s in stops if isinstance(s, str))
        if chars > self.max_stop_chars:
            raise bad_request(
                f"The stop strings have {chars} characters in all; at most "
                f"{self.max_stop_chars} are allowed.",
                "stop",
                "stop_strings_too_long",
            )
        stop_ids = body.get("stop_token_ids")
        if isinstance(stop_ids, list) and len(stop_ids) > self.max_stop_strings:
            raise bad_request(
                f"The request has {len(stop_ids)} stop_token_ids; at most "
                f"{self.max_stop_strings} are allowed.",
                "stop_token_ids",
                "too_many_stop_token_ids",
            )
        return max(n, 1)

    def _check_seqs(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_seqs_per_request:
            raise bad_request(
                f"The request asks for {num_prompts * n} sequences ({num_prompts} prompts x "
                f"n={n}); at most {self.max_seqs_per_request} are allowed per request.",
                "n",
                "too_many_sequences",
            )


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_ids_len(num_tokens: int, max_model_len: int) -> None:
    if num_tokens >= max_model_len:
        raise context_length_exceeded(max_model_len, f"your prompt has {num_tokens} tokens")


def context_length_exceeded(max_model_len: int, what: str, param: str = "prompt") -> APIError:
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, {what}; at "
        "least one token must be generated.",
        param,
        "context_length_exceeded",
    )
