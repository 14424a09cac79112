"""Trace replay: JSONL files of timed requests, read into a :class:`Workload` and written back.

One JSON object per line, one request each:

- ``arrival_time``: seconds from the start of the run (or ``timestamp`` in milliseconds, the
  Mooncake trace convention);
- the prompt: ``prompt`` (text), ``prompt_token_ids`` / ``token_ids`` (ids), or Mooncake's
  ``input_length`` + ``hash_ids`` (one id per ``hash_block_size`` tokens; equal ids mean equal
  content, so prefix sharing is preserved: each id becomes a fixed block of random tokens);
- ``output_len`` (or ``output_length`` / ``max_tokens``);
- optional ``session_id`` and ``group``, kept for the report.

Each record is replayed as is (a single-turn session): a trace already holds full prompts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvserve.bench.workloads import Content, Session, Turn, Vocab, Workload


@dataclass
class TraceEntry:
    """One request of a trace."""

    arrival_time: float
    prompt: Content
    output_len: int
    session_id: str | None = None
    group: int | None = None

    def to_json(self) -> dict:
        d: dict = {"arrival_time": round(self.arrival_time, 6)}
        if isinstance(self.prompt, str):
            d["prompt"] = self.prompt
        else:
            d["prompt_token_ids"] = list(self.prompt)
        d["output_len"] = self.output_len
        if self.session_id is not None:
            d["session_id"] = self.session_id
        if self.group is not None:
            d["group"] = self.group
        return d


def _hash_block_tokens(hash_id: int, n: int, vocab: Vocab) -> list[int]:
    return vocab.sample(random.Random(f"trace-block:{hash_id}"), n)


def parse_entry(obj: dict, *, vocab: Vocab | None = None, hash_block_size: int = 512) -> TraceEntry:
    """One trace record -> :class:`TraceEntry` (``ValueError`` naming what is missing)."""
    if "arrival_time" in obj:
        t = float(obj["arrival_time"])
    elif "timestamp" in obj:
        t = float(obj["timestamp"]) / 1000.0
    else:
        t = 0.0
    out = obj.get("output_len", obj.get("output_length", obj.get("max_tokens")))
    if out is None:
        raise ValueError("trace record has no output_len / output_length / max_tokens")
    prompt: Content
    if "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str | list):
            raise ValueError("trace 'prompt' must be text or a list of token ids")
    elif "prompt_token_ids" in obj or "token_ids" in obj:
        prompt = [int(i) for i in obj.get("prompt_token_ids", obj.get("token_ids"))]
    elif "hash_ids" in obj and "input_length" in obj:
        if vocab is None:
            raise ValueError("hash_ids traces need a vocabulary (--tokenizer / --vocab-size)")
        n = int(obj["input_length"])
        prompt = []
        for h in obj["hash_ids"]:
            take = min(hash_block_size, n - len(prompt))
            if take <= 0:
                break
            prompt += _hash_block_tokens(int(h), hash_block_size, vocab)[:take]
        if len(prompt) < n:  # more tokens than hash ids cover: a private tail
            rng = random.Random(f"trace-tail:{obj['hash_ids']}:{n}")
            prompt += vocab.sample(rng, n - len(prompt))
    else:
        raise ValueError("trace record has no prompt, prompt_token_ids or hash_ids")
    if not prompt:
        raise ValueError("trace record has an empty prompt")
    sid = obj.get("session_id")
    group = obj.get("group")
    return TraceEntry(t, prompt, int(out), None if sid is None else str(sid), group)


def load_trace(
    path: str | Path,
    *,
    vocab: Vocab | None = None,
    hash_block_size: int = 512,
    time_scale: float = 1.0,
    max_requests: int | None = None,
) -> Workload:
    """Read a JSONL trace; arrival times are shifted to start at 0 and multiplied by
    ``time_scale`` (0.5 replays twice as fast)."""
    entries: list[TraceEntry] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                entries.append(parse_entry(obj, vocab=vocab, hash_block_size=hash_block_size))
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from e
            if max_requests is not None and len(entries) >= max_requests:
                break
    entries.sort(key=lambda e: e.arrival_time)
    t0 = entries[0].arrival_time if entries else 0.0
    kinds = {isinstance(e.prompt, str) for e in entries}
    if len(kinds) > 1:
        raise ValueError(f"{path}: mixes text and token-id prompts")
    sessions = [
        Session(
            session_id=e.session_id or f"t{i}",
            turns=[Turn(e.prompt, e.output_len)],
            arrival_time=(e.arrival_time - t0) * time_scale,
            group=e.group,
        )
        for i, e in enumerate(entries)
    ]
    kind = "text" if kinds == {True} else "tokens"
    params = dict(path=str(path), time_scale=time_scale, requests=len(entries))
    return Workload("trace", sessions, kind, params)


def workload_entries(
    workload: Workload, arrival_times: list[float] | None = None
) -> list[TraceEntry]:
    """A single-turn workload as trace entries (sessions' own arrival times, else the given
    ones, else 0). Multi-turn prompts depend on answers: record them with the load generator."""
    out = []
    for i, s in enumerate(workload.sessions):
        if len(s.turns) != 1:
            raise ValueError("only single-turn workloads can be written as a trace directly")
        t = s.arrival_time
        if t is None:
            t = arrival_times[i] if arrival_times is not None else 0.0
        turn = s.turns[0]
        if isinstance(turn.user, str):
            prompt: Content = (s.prefix + "\n" + turn.user) if s.prefix else turn.user
        else:
            prompt = list(s.prefix or []) + list(turn.user)
        out.append(TraceEntry(t, prompt, turn.output_len, s.session_id, s.group))
    return out


def write_trace(path: str | Path, entries: Iterable[TraceEntry]) -> int:
    """Write entries as JSONL; returns the number written."""
    n = 0
    with open(path, "w") as f:
        for e in entries:
            f.write(json.dumps(e.to_json()) + "\n")
            n += 1
    return n
