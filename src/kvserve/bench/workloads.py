"""Seeded, deterministic benchmark workloads: what is asked, by whom, and in which order.

A workload is a list of :class:`Session` s. A session is one user: an optional shared
``prefix`` (a system prompt, a prefix group's document) and one or more :class:`Turn` s, each
carrying only the *new* user content, the output length and the think time before it. The
prompt of a turn is built from the session's history by :class:`Conversation` once the
previous turn's answer is known (the driver feeds each answer back), so multi-turn prompts
contain the answers the server actually produced:

    prompt(turn k) = prompt(turn k-1) + answer(turn k-1) + user(turn k)

Content is either token ids (``kind="tokens"``: exact lengths, sent as ``prompt: [ints]``) or
text (``kind="text"``: words from a fixed list, about one token per word; sent as a string or
as chat messages). Every generator takes a ``seed``; the same arguments give the same
workload on every machine (Python's ``random.Random``, whose streams are stable).

This module owns workload shapes only; sending them is ``loadgen`` / ``offline``; traces
(JSONL replay) are in ``trace``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Content = list[int] | str
ContentKind = Literal["tokens", "text"]
Api = Literal["completions", "chat"]


@dataclass
class Turn:
    """One request of a session: the new user content, its output length, the pause before."""

    user: Content
    output_len: int
    think_time: float = 0.0  # seconds between the previous answer and this request


@dataclass
class Session:
    """One user's requests, sent in order (each turn after the previous answer)."""

    session_id: str
    turns: list[Turn]
    prefix: Content = field(default_factory=list)  # shared prefix; empty when none
    arrival_time: float | None = None  # seconds after start (traces); None: arrival process
    group: int | None = None  # system prompt / prefix group index, for analysis


@dataclass
class Workload:
    name: str
    sessions: list[Session]
    kind: ContentKind = "tokens"
    params: dict = field(default_factory=dict)  # generator arguments, for the report

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.name}({args}): {len(self.sessions)} sessions, {self.num_requests} requests"


@dataclass
class Vocab:
    """Token ids a synthetic prompt may use: ``[0, vocab_size)`` minus special tokens."""

    vocab_size: int
    special_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        self._allowed = [i for i in range(self.vocab_size) if i not in self.special_ids]
        if not self._allowed:
            raise ValueError("vocabulary has no ordinary tokens")

    def sample(self, rng: random.Random, n: int) -> list[int]:
        allowed = self._allowed
        k = len(allowed)
        return [allowed[int(rng.random() * k)] for _ in range(n)]

    @classmethod
    def from_model_dir(cls, path: str | Path) -> Vocab:
        """Read the vocabulary size and special ids of a Hugging Face-format directory."""
        path = Path(path)
        special: set[int] = set()
        size = 0
        tok_file = path / "tokenizer.json"
        if tok_file.exists():
            data = json.loads(tok_file.read_text())
            size = len(data.get("model", {}).get("vocab", {}))
            for tok in data.get("added_tokens", []):
                size = max(size, tok["id"] + 1)
                if tok.get("special", True):
                    special.add(tok["id"])
        cfg_file = path / "config.json"
        if cfg_file.exists():
            cfg = json.loads(cfg_file.read_text())
            # Ids past the tokenizer's size exist in the embedding but never occur in text.
            size = min(size, cfg["vocab_size"]) if size else cfg["vocab_size"]
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                v = cfg.get(key)
                for i in v if isinstance(v, list) else [v]:
                    if isinstance(i, int):
                        special.add(i)
        if not size:
            raise FileNotFoundError(f"no tokenizer.json or config.json in {path}")
        return cls(size, frozenset(special))


# A fixed word list for text content (deterministic, no data files). Common short English
# words: byte-level BPE tokenizers mostly map each to one token (with its leading space).
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her it an are were which "
    "this be or has had not but what all when there can out one who more their about would "
    "them some time these two into other then its could up than first been now only people "
    "over new after also did many made most may way before see very through back years where "
    "much your well down should because each just those how too little state good long make "
    "world still own under last while might us great old year off come since against go came "
    "right used take three small large place house water city light river stone music paper "
    "table story market garden window family season number question system morning evening "
    "north south east west green blue red white black open close early late quick slow"
)
_WORDS = _WORD_TEXT.split()


def sample_text(rng: random.Random, n: int) -> str:
    """About ``n`` tokens of text: ``n`` words from the fixed list."""
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _content(kind: ContentKind, rng: random.Random, n: int, vocab: Vocab | None) -> Content:
    if kind == "tokens":
        if vocab is None:
            raise ValueError("token-id workloads need a vocabulary (Vocab or --tokenizer)")
        return vocab.sample(rng, n)
    return sample_text(rng, n)


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """A length uniform in ``[mean*(1-r), mean*(1+r)]`` (exactly ``mean`` when r == 0)."""
    if range_ratio <= 0:
        return mean
    lo = max(1, int(mean * (1 - range_ratio)))
    hi = max(lo, int(mean * (1 + range_ratio)))
    return rng.randint(lo, hi)


# ---------------------------------------------------------------------------------------------
# Generators


def random_workload(
    num_prompts: int = 200,
    input_len: int = 512,
    output_len: int = 128,
    *,
    vocab: Vocab | None = None,
    kind: ContentKind = "tokens",
    range_ratio: float = 0.0,
    seed: int = 0,
) -> Workload:
    """Independent single-turn requests with random content (no shared prefixes)."""
    rng = random.Random(f"random:{seed}")
    sessions = [
        Session(
            session_id=f"r{i}",
            turns=[
                Turn(
                    _content(kind, rng, _length(rng, input_len, range_ratio), vocab),
                    _length(rng, output_len, range_ratio),
                )
            ],
        )
        for i in range(num_prompts)
    ]
    params = dict(num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    params.update(range_ratio=range_ratio, seed=seed)
    return Workload("random", sessions, kind, params)


def multi_turn_workload(
    num_sessions: int = 32,
    num_turns: int = 5,
    *,
    first_len: int = 256,  # tokens of the first user message
    user_len: int = 64,  # tokens of each later user message
    output_len: int = 64,
    think_time: float = 1.0,  # mean seconds between an answer and the next question
    system_prompt_len: int = 0,  # a system prompt shared by every session (0: none)
    vocab: Vocab | None = None,
    kind: ContentKind = "tokens",
    range_ratio: float = 0.0,
    seed: int = 0,
) -> Workload:
    """Chat sessions whose history grows turn by turn; exponential think times."""
    rng = random.Random(f"multi-turn:{seed}")
    system = _content(kind, rng, system_prompt_len, vocab) if system_prompt_len else []
    sessions = []
    for i in range(num_sessions):
        turns = []
        for t in range(num_turns):
            n = _length(rng, first_len if t == 0 else user_len, range_ratio)
            pause = 0.0 if t == 0 or think_time <= 0 else rng.expovariate(1.0 / think_time)
            turns.append(Turn(_content(kind, rng, n, vocab), output_len, pause))
        sessions.append(Session(f"s{i}", turns, prefix=system))
    params = dict(num_sessions=num_sessions, num_turns=num_turns, first_len=first_len)
    params.update(user_len=user_len, output_len=output_len, think_time=think_time)
    params.update(system_prompt_len=system_prompt_len, seed=seed)
    return Workload("multi-turn", sessions, kind, params)


def _grouped_workload(
    name: str,
    num_groups: int,
    users_per_group: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
    num_turns: int,
    think_time: float,
    vocab: Vocab | None,
    kind: ContentKind,
    shuffle: bool,
    seed: int,
) -> list[Session]:
    rng = random.Random(f"{name}:{seed}")
    prefixes = [_content(kind, rng, prefix_len, vocab) for _ in range(num_groups)]
    sessions = []
    for g in range(num_groups):
        for u in range(users_per_group):
            turns = []
            for t in range(num_turns):
                pause = 0.0 if t == 0 or think_time <= 0 else rng.expovariate(1.0 / think_time)
                turns.append(Turn(_content(kind, rng, question_len, vocab), output_len, pause))
            sessions.append(Session(f"g{g}u{u}", turns, prefix=prefixes[g], group=g))
    if shuffle:
        rng.shuffle(sessions)
    return sessions


def system_prompt_workload(
    num_system_prompts: int = 4,
    num_users: int = 128,
    *,
    system_prompt_len: int = 1024,
    question_len: int = 128,
    output_len: int = 64,
    num_turns: int = 1,
    think_time: float = 0.0,
    vocab: Vocab | None = None,
    kind: ContentKind = "tokens",
    seed: int = 0,
) -> Workload:
    """K system prompts shared by many users (each user picks one at random)."""
    rng = random.Random(f"system-prompt:{seed}")
    prompts = [_content(kind, rng, system_prompt_len, vocab) for _ in range(num_system_prompts)]
    sessions = []
    for u in range(num_users):
        g = rng.randrange(num_system_prompts)
        turns = []
        for t in range(num_turns):
            pause = 0.0 if t == 0 or think_time <= 0 else rng.expovariate(1.0 / think_time)
            turns.append(Turn(_content(kind, rng, question_len, vocab), output_len, pause))
        sessions.append(Session(f"u{u}", turns, prefix=prompts[g], group=g))
    params = dict(num_system_prompts=num_system_prompts, num_users=num_users)
    params.update(system_prompt_len=system_prompt_len, question_len=question_len)
    params.update(output_len=output_len, num_turns=num_turns, seed=seed)
    return Workload("system-prompt", sessions, kind, params)


def prefix_groups_workload(
    num_groups: int = 150,
    users_per_group: int = 5,
    *,
    prefix_len: int = 6000,
    question_len: int = 128,
    output_len: int = 64,
    num_turns: int = 1,
    think_time: float = 0.0,
    vocab: Vocab | None = None,
    kind: ContentKind = "tokens",
    seed: int = 0,
) -> Workload:
    """G groups, each a long shared prefix, many users per group, arrivals interleaved.

    The defaults are llm-d's published experiment (150 groups x 6k-token prefixes); size it to
    a cluster with :func:`size_prefix_groups`.
    """
    sessions = _grouped_workload(
        "prefix-groups",
        num_groups,
        users_per_group,
        prefix_len,
        question_len,
        output_len,
        num_turns,
        think_time,
        vocab,
        kind,
        True,
        seed,
    )
    params = dict(num_groups=num_groups, users_per_group=users_per_group, prefix_len=prefix_len)
    params.update(question_len=question_len, output_len=output_len, num_turns=num_turns)
    params.update(seed=seed)
    return Workload("prefix-groups", sessions, kind, params)


def size_prefix_groups(
    kv_capacity_tokens: int,
    fraction: float = 0.7,
    *,
    prefix_len: int | None = None,
    num_groups: int | None = None,
    block_size: int = 16,
) -> tuple[int, int]:
    """``(num_groups, prefix_len)`` so the groups' prefixes fill ``fraction`` of the KV capacity.

    ``kv_capacity_tokens`` is the whole cluster's (instances x blocks x block size, see
    :func:`kv_capacity_tokens`). Give one of ``prefix_len`` / ``num_groups``; the other is
    derived. Prefixes are counted in whole blocks, as the cache holds them.
    """
    if (prefix_len is None) == (num_groups is None):
        raise ValueError("give exactly one of prefix_len and num_groups")
    if not 0 < fraction <= 1:
        raise ValueError("fraction must be in (0, 1]")
    budget = fraction * kv_capacity_tokens
    if prefix_len is not None:
        blocks = -(-prefix_len // block_size)
        return max(1, round(budget / (blocks * block_size))), prefix_len
    assert num_groups is not None
    blocks = int(budget // (num_groups * block_size))
    if blocks < 1:
        raise ValueError("capacity too small for that many groups")
    return num_groups, blocks * block_size


def kv_capacity_tokens(num_instances: int, num_blocks: int, block_size: int = 16) -> int:
    """Tokens of KV a cluster holds in its primary pools."""
    return num_instances * num_blocks * block_size


# ---------------------------------------------------------------------------------------------
# Building each turn's prompt from the history


@dataclass
class TurnRequest:
    """What to send for one turn: a completions ``prompt`` or chat ``messages``."""

    session_id: str
    turn: int
    output_len: int
    think_time: float
    prompt: Content | None = None
    messages: list[dict[str, str]] | None = None
    group: int | None = None

    @property
    def num_prompt_tokens(self) -> int | None:
        """Exact for token-id prompts; unknown (None) for text."""
        return len(self.prompt) if isinstance(self.prompt, list) else None


class Conversation:
    """The history of one session; yields each turn's request once the last answer is known.

    ``api="chat"`` keeps a message list (prefix as the system message); ``"completions"``
    concatenates: token ids directly (the answer's token ids, or ``tokenize(answer_text)`` when
    the server returned only text), text with ``separator`` between parts.
    """

    def __init__(
        self,
        session: Session,
        api: Api = "completions",
        *,
        separator: str = "\n",
        tokenize: Callable[[str], list[int]] | None = None,
    ) -> None:
        self.session = session
        self.api = api
        self.separator = separator
        self.tokenize = tokenize
        self.turn = 0
        self._prompt: Content | None = None
        self._messages: list[dict[str, str]] = []
        self._awaiting_answer = False

    @property
    def done(self) -> bool:
        return self.turn >= len(self.session.turns)

    def next_request(self) -> TurnRequest:
        if self.done:
            raise IndexError("session has no more turns")
        if self._awaiting_answer:
            raise RuntimeError("record_answer() the previous turn first")
        turn = self.session.turns[self.turn]
        req = TurnRequest(
            self.session.session_id,
            self.turn,
            turn.output_len,
            turn.think_time,
            group=self.session.group,
        )
        if self.api == "chat":
            if not isinstance(turn.user, str):
                raise ValueError("the chat API needs a text workload (kind='text')")
            if self.turn == 0 and self.session.prefix:
                self._messages.append({"role": "system", "content": str(self.session.prefix)})
            self._messages.append({"role": "user", "content": turn.user})
            req.messages = [dict(m) for m in self._messages]
        else:
            if self._prompt is None:
                self._prompt = self._join(self.session.prefix, turn.user)
            else:
                self._prompt = self._join(self._prompt, turn.user)
            req.prompt = list(self._prompt) if isinstance(self._prompt, list) else self._prompt
        self._awaiting_answer = True
        return req

    def end(self) -> None:
        """Give up on the rest of the session (its last request failed)."""
        self.turn = len(self.session.turns)
        self._awaiting_answer = False

    def record_answer(self, text: str, token_ids: Sequence[int] | None = None) -> None:
        """Feed back the answer the server produced for the last request."""
        if not self._awaiting_answer:
            raise RuntimeError("no request is awaiting an answer")
        self._awaiting_answer = False
        self.turn += 1
        if self.done:
            return
        if self.api == "chat":
            self._messages.append({"role": "assistant", "content": text})
        elif isinstance(self._prompt, list):
            if token_ids is None:
                if self.tokenize is None:
                    raise ValueError(
                        "a multi-turn token-id workload needs the answer's token ids or a "
                        "tokenizer (--tokenizer) to turn the answer text into ids"
                    )
                token_ids = self.tokenize(text)
            self._prompt = self._prompt + list(token_ids)
        else:
            assert isinstance(self._prompt, str)
            self._prompt = self._prompt + text

    def _join(self, head: Content, tail: Content) -> Content:
        if isinstance(tail, list):
            if not isinstance(head, list):
                raise ValueError("mixed text and token-id content")
            return head + tail
        if not isinstance(head, str):
            if head:
                raise ValueError("mixed text and token-id content")
            head = ""
        return head + self.separator + tail if head else tail
