"""The engine-side KV event publisher over real ZMQ sockets: wire format, sequence numbers,
replay protocol of specs/kv-events.md, bounded buffer, bad requests, never blocking."""

from __future__ import annotations

import time

import pytest
import zmq

from kvserve.kv.event_publisher import ZmqEventPublisher, pack_seq, unpack_seq
from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch


def _stored(i: int) -> BlockStored:
    return BlockStored(
        block_hashes=[i], parent_block_hash=None, token_ids=[i] * 4, block_size=4, medium="GPU"
    )


def _sub(ctx: zmq.Context, address: str, topic: bytes = b"") -> zmq.Socket:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, topic)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(address)
    return s


def _wait_connected(pub: ZmqEventPublisher, sub: zmq.Socket) -> int:
    """PUB drops messages until the SUB has joined: publish probes until one arrives."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pub.publish([AllBlocksCleared()])
        if sub.poll(50):
            return unpack_seq(sub.recv_multipart()[1])
    raise AssertionError("subscriber never connected")


def _replay(ctx: zmq.Context, address: str, start: int) -> list[list[bytes]]:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.RCVTIMEO, 5000)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(address)
    d.send_multipart([b"", pack_seq(start)])
    out = []
    while True:
        frames = d.recv_multipart()
        assert frames[0] == b""
        if unpack_seq(frames[2]) == -1:
            assert frames[1] == b"" and frames[3] == b""
            break
        out.append(frames[1:])
    d.close()
    return out


def test_wire_format_sequence_and_replay() -> None:
    ctx = zmq.Context.instance()
    with ZmqEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv@h:1@m", buffer_size=8
    ) as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and pub.replay_endpoint
        sub = _sub(ctx, pub.endpoint, b"kv@")
        first = _wait_connected(pub, sub)
        pub.publish([])  # nothing to publish: no batch, no seq
        pub.publish([_stored(1), BlockRemoved(block_hashes=[1])])
        pub.publish([_stored(2)])
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv@h:1@m" and len(seq) == 8
        assert unpack_seq(seq) == first + 1
        batch = decode_batch(payload)
        assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved"]
        assert abs(batch.ts - time.time()) < 60
        assert unpack_seq(sub.recv_multipart()[1]) == first + 2
        assert pub.flush()
        # Replay from the first real batch: exactly the two, in order, same frames.
        got = _replay(ctx, pub.replay_endpoint, first + 1)
        assert [unpack_seq(f[1]) for f in got] == [first + 1, first + 2]
        assert got[0][0] == b"kv@h:1@m"
        assert decode_batch(got[1][2]).events[0].block_hashes == [2]
        # Only the last 8 batches are kept.
        for i in range(20):
            pub.publish([_stored(100 + i)])
        assert pub.flush()
        got = _replay(ctx, pub.replay_endpoint, 0)
        seqs = [unpack_seq(f[1]) for f in got]
        assert len(seqs) == 8 and seqs == list(range(pub.next_seq - 8, pub.next_seq))
        assert _replay(ctx, pub.replay_endpoint, pub.next_seq) == []  # nothing newer
        sub.close()


def test_sequence_starts_at_zero_and_malformed_replay_requests_are_ignored() -> None:
    ctx = zmq.Context.instance()
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        pub.publish([_stored(1)])
        assert pub.flush()
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(pub.replay_endpoint)
        d.send_multipart([b"", b"\x00\x01"])  # seq frame of the wrong size
        assert not d.poll(300)
        d.close()
        got = _replay(ctx, pub.replay_endpoint, 0)
        assert [unpack_seq(f[1]) for f in got] == [0]


def test_close_sends_everything_queued_in_order() -> None:
    ctx = zmq.Context.instance()
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_size=20000)
    sub = _sub(ctx, pub.endpoint)
    first = _wait_connected(pub, sub)
    events = [_stored(i) for i in range(8)]
    for _ in range(5000):
        pub.publish(events)
    pub.close()
    seqs = [unpack_seq(sub.recv_multipart()[1]) for _ in range(5000)]
    assert seqs == list(range(first + 1, first + 5001))
    pub.publish(events)  # after close: ignored, no error
    sub.close()


def test_bind_errors_surface_in_the_constructor() -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:*") as pub, pytest.raises(zmq.ZMQError):
        ZmqEventPublisher(pub.endpoint)
    with pytest.raises(ValueError):
        ZmqEventPublisher("tcp://127.0.0.1:*", buffer_size=0)
