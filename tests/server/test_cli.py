"""`kvserve serve` as a real process: serves, publishes KV events, exits cleanly on SIGTERM."""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import zmq

from kvserve.bench.ports import free_port
from kvserve.kv.events import BlockStored, decode_batch


def test_serve_command_end_to_end(tiny_model_dir: Path):
    events_port = free_port()  # below the ephemeral range: see kvserve.bench.ports
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvserve.cli",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--served-model-name",
            "tiny-cli",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--num-kv-blocks",
            "64",
            "--max-model-len",
            "256",
            "--kv-events-endpoint",
            f"tcp://127.0.0.1:{events_port}",
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    log: list[str] = []

    def drain() -> None:  # keeps the pipe from filling up
        for line in proc.stderr:
            log.append(line)
            lines.put(line)

    threading.Thread(target=drain, daemon=True).start()
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        url = None
        while url is None:
            try:
                line = lines.get(timeout=90)
            except queue.Empty:
                raise AssertionError("server did not start: " + "".join(log)) from None
            if m := re.search(r"serving 'tiny-cli' on (http://\S+)", line):
                url = m.group(1)
        port = int(url.rsplit(":", 1)[1])
        topic = f"kv@127.0.0.1:{port}@tiny-cli".encode()
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        sub.setsockopt(zmq.RCVTIMEO, 5_000)
        sub.connect(f"tcp://127.0.0.1:{events_port}")
        time.sleep(0.3)  # let the subscription reach the publisher

        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        prompt = "Block after block, the cache grows; the router learns where every prefix lives."
        # The first request may run before the subscription is through: send until seen.
        stored: list[BlockStored] = []
        for attempt in range(5):
            resp = client.completions.create(
                model="tiny-cli", prompt=f"{attempt} {prompt}", max_tokens=2, temperature=0
            )
            assert resp.choices[0].text is not None
            try:
                while not stored:
                    got_topic, _seq, payload = sub.recv_multipart()
                    assert got_topic == topic
                    events = decode_batch(payload).events
                    stored += [e for e in events if isinstance(e, BlockStored)]
                break
            except zmq.Again:
                continue
        assert stored and stored[0].block_size == 16
        assert client.models.list().data[0].id == "tiny-cli"

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, "".join(log)
    finally:
        sub.close(linger=0)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
