"""Large prompts against real servers: tokenized in a worker process while /health and other
clients are answered, the same token ids as inline, memory given back afterwards."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvserve.config import ServerConfig
from kvserve.server.tokenizer_pool import INLINE_CHARS, INLINE_MESSAGES

from .conftest import ServeProcess, start_serve_process

TEXT = "The history of the world is long, and the quick brown fox jumps over all of it. "
# ~11.6 characters per token with the tiny vocabulary: too sparse in tokens to be refused from
# its prefix (tokenizer_worker.PREFIX_FACTOR), so the whole text is tokenized.
SPARSE = " mathematician grandmother wavelengths experiments clockmaker carefully Wednesday"


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _tree_rss(pid: int) -> int:
    """RSS of the server and its tokenizer worker(s)."""
    return _rss(pid) + sum(_rss(c) for c in _children(pid))


@pytest.fixture(scope="module")
def long_server(long_model_dir: Path):
    proc = start_serve_process(long_model_dir, "--num-kv-blocks", "256")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads RSS from /proc")
def test_large_prompt_does_not_stall_other_clients(long_server: ServeProcess):
    """A 7 MB prompt (65,536-token context, so it passes the character bound; sparse in
    tokens, so it is tokenized whole) takes seconds to tokenize; meanwhile /health and another
    client's completion are answered promptly (before: the event loop was frozen for the whole
    encode), and memory comes back afterwards."""
    url = long_server.url
    with httpx.Client(base_url=url, timeout=120) as http:
        # Warm up prefill and decode (the first steps allocate); the worker starts on the
        # first prompt over the inline size.
        for prompt in (TEXT * 60, "Hi there", "Hello"):
            body = {"prompt": prompt, "max_tokens": 8, "ignore_eos": True}
            warm = http.post("/v1/completions", json=body)
            assert warm.status_code == 200 and warm.json()["usage"]["completion_tokens"] == 8
        before = _tree_rss(long_server.pid)
        big = (SPARSE * (7_000_000 // len(SPARSE) + 1))[:7_000_000]
        result: dict[str, object] = {}

        def send_big() -> None:
            start = time.monotonic()
            with httpx.Client(base_url=url, timeout=300) as c:
                resp = c.post("/v1/completions", json={"prompt": big, "max_tokens": 1})
            result["resp"], result["seconds"] = resp, time.monotonic() - start

        thread = threading.Thread(target=send_big)
        thread.start()
        time.sleep(0.5)  # the body is in, tokenization under way
        health: list[float] = []
        others: list[float] = []
        while thread.is_alive():
            t = time.monotonic()
            assert http.get("/health").status_code == 200
            health.append(time.monotonic() - t)
            if len(health) % 10 == 1:
                t = time.monotonic()
                resp = http.post("/v1/completions", json={"prompt": "Hi there", "max_tokens": 2})
                assert resp.status_code == 200, resp.text
                others.append(time.monotonic() - t)
            time.sleep(0.02)
        thread.join()
        resp = result["resp"]
        assert isinstance(resp, httpx.Response) and resp.status_code == 400, resp
        err = resp.json()["error"]
        assert err["code"] == "context_length_exceeded" and "tokens" in err["message"]
        assert len(health) >= 5, (health, result["seconds"])
        # Generous bounds for a loaded 2-core machine; a frozen loop takes seconds.
        assert max(health) < 1.0, sorted(health)[-5:]
        assert max(others) < 3.0, others
        # Prose of the same size is refused from its first 16 x 65,536 characters.
        prose = (TEXT * (7_000_000 // len(TEXT) + 1))[:7_000_000]
        resp = http.post("/v1/completions", json={"prompt": prose, "max_tokens": 1})
        assert "the first 1048576 characters of your prompt alone are" in resp.text, resp.text
        # Memory: back within 10% once the worker trimmed its heap.
        deadline = time.monotonic() + 20
        while (after := _tree_rss(long_server.pid)) > 1.1 * before:
            assert time.monotonic() < deadline, (before, after)
            time.sleep(0.5)


def test_worker_tokenizes_like_inline(server_factory, tiny_model_dir):
    """Prompts over the inline size go through the worker process: same ids, same errors."""
    served = server_factory(max_model_len=2048, num_kv_blocks=300)
    tok = served.engine.tokenizer
    pool = served.server.config.app.state.tokenizers
    long_text = (TEXT * (INLINE_CHARS // len(TEXT) + 2))[: INLINE_CHARS + 500]
    msgs = [{"role": "user", "content": f"Message {i}."} for i in range(INLINE_MESSAGES + 1)]
    with served.http() as http:
        resp = http.post("/v1/completions", json={"prompt": long_text, "max_tokens": 1})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["prompt_tokens"] == len(tok.encode(long_text))
        resp = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["prompt_tokens"] == len(tok.encode_chat(msgs))
        assert pool.num_running_workers == 1
        # Errors from the worker: the template's (unknown role), and a prompt too long.
        bad = [*msgs, {"role": "tool", "content": "x"}]
        resp = http.post("/v1/chat/completions", json={"messages": bad})
        assert resp.status_code == 400 and "tool" in resp.json()["error"]["message"]
        resp = http.post("/v1/completions", json={"prompt": TEXT * 400})
        assert resp.status_code == 400
        assert resp.json()["error"]["code"] == "context_length_exceeded"
        # A worker that dies is replaced; its requests get 503, never a 500.
        for pid in pool.worker_pids():
            os.kill(pid, 9)
        statuses = []
        for _ in range(3):
            resp = http.post("/v1/completions", json={"prompt": long_text, "max_tokens": 1})
            statuses.append(resp.status_code)
        assert statuses[-1] == 200 and set(statuses) <= {200, 503}, statuses
    served.wait_idle()


def test_no_workers_means_inline(server_factory):
    served = server_factory(
        ServerConfig(tokenizer_workers=0), max_model_len=2048, num_kv_blocks=128
    )
    with served.http() as http:
        resp = http.post("/v1/completions", json={"prompt": TEXT * 60, "max_tokens": 1})
        assert resp.status_code == 200, resp.text
    assert served.server.config.app.state.tokenizers.num_running_workers == 0
