"""The router's memory after large requests (issue 17: "memory after a maximal request returns
to within 10% of before"). A real `kvserve route` process (tokenizing with the tiny preset's
tokenizer) in front of a fake backend in another process; RSS read from /proc."""

from __future__ import annotations

import asyncio
import json
import os
import time
import tracemalloc
from pathlib import Path

import pytest

from .processes import fake_backends, raw_request, router_process

JSON = {"content-type": "application/json"}
# ~11 characters per token with the tiny vocabulary: a long text reaches the router's token
# cap (131,072 when the endpoints report no context) only after ~1.5M characters.
WORDS = " mathematician grandmother wavelengths experiments clockmaker carefully Wednesday"


def _text(chars: int) -> str:
    return (WORDS * (chars // len(WORDS) + 1))[:chars]


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _router_pid(url: str) -> int:
    """The `kvserve route` process started by ``router_process`` for ``url``."""
    marker = f"router-{url.rsplit(':', 1)[1]}.yaml".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker in f.read():
                        return int(entry)
            except OSError:
                pass
    raise RuntimeError("router process not found")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_rss_returns_within_10_percent_after_large_requests(tmp_path: Path, tiny_model_dir) -> None:
    """Three 32 MiB completions bodies through a warmed-up router: its RSS afterwards is
    within 10% of before. Before the fix each body stayed referenced by its client
    connection (a reference cycle with the HTTP parser, freed only by a full garbage
    collection): +32 MiB per request on a ~50 MiB process."""
    size = 32 << 20
    head, tail = b'{"model": "m", "max_tokens": 1, "prompt": "', b'"}'
    big = head + _text(size - len(head) - len(tail)).encode() + tail
    with fake_backends(1) as urls:
        cfg = {"endpoints": urls, "tokenizer": str(tiny_model_dir)}
        with router_process(tmp_path, cfg) as url:
            pid = _router_pid(url)

            async def post(body: bytes, path: str = "/v1/completions") -> int:
                r = await raw_request(url, "POST", path, body, JSON, timeout=120)
                return r.status

            async def main() -> tuple[int, int, list[int]]:
                # Warm up: the tokenizer loaded, a long prompt tokenized on a worker thread,
                # a chat template rendered.
                for prompt in ("hello", _text(20_000), _text(300_000)):
                    assert await post(json.dumps({"model": "m", "prompt": prompt}).encode()) == 200
                chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                assert await post(json.dumps(chat).encode(), "/v1/chat/completions") == 200
                await asyncio.sleep(1.0)
                before = _rss(pid)
                statuses = [await post(big) for _ in range(3)]
                await asyncio.sleep(1.0)
                return before, _rss(pid), statuses

            before, after, statuses = asyncio.run(main())
    assert statuses == [200, 200, 200]
    assert after <= 1.10 * before, f"RSS {before >> 20} MiB before, {after >> 20} MiB after"


def test_a_long_prompt_is_not_held_as_python_ints(tiny_model_dir) -> None:
    """Tokenizing a prompt up to the router's cap (131,072 tokens) keeps its ids in a uint32
    array filled a chunk at a time. Before, they were a list of 131,072 Python ints (~5 MiB of
    small objects at once, whose arenas the allocator kept after the request: the router's
    RSS stayed ~4 MiB, 8%, higher after its first maximal request)."""
    from kvserve.cluster.tokenization import PrefixEncoder
    from kvserve.model.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model_dir)
    text = _text(2_000_000)
    PrefixEncoder(tok, 1000).encode(text)  # the split probe and the tokenizer warmed up
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        ids = PrefixEncoder(tok, 131072).encode(text)
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(ids) == 131072
    assert list(ids[:1000]) == tok.encode(text[:20_000])[:1000]  # the same tokens
    assert peak < 3 << 20, f"peak {peak / (1 << 20):.1f} MiB of Python objects ({elapsed:.1f} s)"
