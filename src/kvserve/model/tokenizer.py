"""Tokenizer of a local Hugging Face model directory, its chat template, and incremental
detokenization for streaming.

Owns text <-> token ids only: ``tokenizer.json`` through the ``tokenizers`` library,
``tokenizer_config.json`` for special tokens and the chat template (rendered in a sandboxed
jinja2 environment, as transformers does). Never downloads anything.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "...", "lstrip": ...} (AddedToken form)
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class Tokenizer:
    """``encode`` / ``decode`` / ``apply_chat_template`` over one model directory."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"no tokenizer.json in {path}")
        self._tok = HFTokenizer.from_file(str(tok_file))
        cfg_file = path / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.bos_token: str | None = _token_text(cfg.get("bos_token"))
        self.eos_token: str | None = _token_text(cfg.get("eos_token"))
        self.pad_token: str | None = _token_text(cfg.get("pad_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        if self.eos_token_id is None:
            gen = path / "generation_config.json"
            eos = json.loads(gen.read_text()).get("eos_token_id") if gen.is_file() else None
            self.eos_token_id = eos[0] if isinstance(eos, list) and eos else eos
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        self.chat_template: str | None = template
        self._compiled = None
        self.all_special_ids: set[int] = {
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }

    # -- ids <-> text --------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the tokenizer's template
        (e.g. the BOS prefix)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    # -- chat ----------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the model's chat template. ``ValueError`` when the model
        has none or the template rejects the conversation."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        if self._compiled is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
                x, ensure_ascii=False, indent=indent
            )
            self._compiled = env.from_string(self.chat_template)
        try:
            return self._compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Prompt token ids of a chat request: the one rule shared by the server, the router
        and ``LLM.chat`` (so the router hashes exactly what the engine caches).

        Content given as OpenAI content parts keeps its text parts, one per line; the
        ``developer`` role is rendered as ``system`` (as OpenAI treats it for models without
        that role). A template that renders the BOS token itself does not get a second one
        from ``encode``.
        """
        msgs = []
        for m in messages:
            role = "system" if m["role"] == "developer" else m["role"]
            msg = {"role": role, "content": chat_message_text(m.get("content"))}
            if m.get("name") is not None:
                msg["name"] = m["name"]
            msgs.append(msg)
        text = self.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
        bos = self.bos_token
        return self.encode(text, add_special_tokens=not (bos and text.startswith(bos)))


def chat_message_text(content: Any) -> str:
    """Text of one message's content: a string, or the text parts of a content-part list."""
    if isinstance(content, list):
        return "\n".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
        )
    return content or ""


class IncrementalDetokenizer:
    """Text of appended token ids, emitted as soon as it is complete UTF-8.

    Decodes only a short window of tokens per step (vLLM's prefix/read offsets): the text of
    ``[prefix_offset, read_offset)`` is already emitted; new text is the decoding of
    ``[prefix_offset, end)`` minus that prefix. Text ending in U+FFFD (an incomplete
    multi-byte character) is held back until the next token completes it, or :meth:`flush`.
    The window start gives tokenizers that drop a leading space (SentencePiece) the context
    they need.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        context_tokens: int = 5,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = list(prompt_token_ids[-context_tokens:]) if context_tokens else []
        self.read_offset = len(self.tokens)
        self.prefix_offset = 0
        self.text = ""  # all text emitted so far

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.tokens[start:end], self.skip_special_tokens)

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Append ``token_ids``; return the newly complete text (possibly empty)."""
        self.tokens.extend(token_ids)
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset, len(self.tokens))
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # incomplete character (or nothing visible yet): wait
        new = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += new
        return new

    def flush(self) -> str:
        """Text held back at the end of the stream (incomplete bytes as U+FFFD)."""
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset, len(self.tokens))
        new = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.text += new
        return new
