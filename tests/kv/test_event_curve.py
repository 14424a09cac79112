"""CURVE on the KV event and replay sockets, over real ZMQ sockets: only a subscriber with
the right keys receives events or replays; with them, events flow and replay works."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import zmq
import zmq.auth

from kvserve.cluster.event_subscriber import EventSubscriber
from kvserve.cluster.kv_index import KVIndex
from kvserve.kv.event_curve import CurveKeyError
from kvserve.kv.event_publisher import ZmqEventPublisher, pack_seq
from kvserve.kv.events import BlockStored

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """Key files of an engine, a router it admits and an intruder it does not."""
    out: dict[str, Path] = {}
    for name in ("engine", "router", "intruder"):
        public, secret = zmq.auth.create_certificates(tmp_path, name)
        out[name] = Path(secret)
        out[name + ".pub"] = Path(public)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "router.key").write_bytes(out["router.pub"].read_bytes())
    out["allowed"] = allowed
    return out


def _batch(i: int) -> list:
    return [
        BlockStored(
            block_hashes=[i], parent_block_hash=None, token_ids=[i] * 4, block_size=4, medium="GPU"
        )
    ]


def _subscriber(pub: ZmqEventPublisher, client_key=None, server_key=None) -> EventSubscriber:
    sub = EventSubscriber(KVIndex(), replay_timeout=1.0, curve_client_key=client_key)
    sub.add_endpoint(
        "e",
        pub.endpoint,
        pub.replay_endpoint,
        curve_server_key=str(server_key) if server_key else None,
    )
    return sub.start()


def _publish_for(pub: ZmqEventPublisher, seconds: float, first: int) -> int:
    """Keep publishing (live traffic) for ``seconds``; returns the next batch number."""
    end = time.monotonic() + seconds
    i = first
    while time.monotonic() < end:
        pub.publish(_batch(i))
        i += 1
        time.sleep(0.05)
    return i


def test_only_admitted_subscribers_get_events_and_replays(keys) -> None:
    with ZmqEventPublisher(
        "tcp://127.0.0.1:*",
        "tcp://127.0.0.1:*",
        curve_secret_key=str(keys["engine"]),
        curve_allowed_clients=str(keys["allowed"]),
    ) as pub:
        for i in range(5):  # before anyone subscribes: reachable by replay only
            pub.publish(_batch(i))
        assert pub.flush()
        plain = _subscriber(pub)
        intruder = _subscriber(pub, keys["intruder"], keys["engine.pub"])
        # The engine's public key with a throwaway client key: refused as well.
        anonymous = _subscriber(pub, None, keys["engine.pub"])
        router = _subscriber(pub, keys["router"], keys["engine.pub"])
        try:
            assert router.wait_for_seq("e", 4, timeout=15)  # replayed on connecting
            assert router.index.endpoint_num_blocks("e") == 5
            n = _publish_for(pub, 2.0, 5)
            assert pub.flush()
            assert router.wait_for_seq("e", n - 1, timeout=15)  # live events flow
            assert router.index.endpoint_num_blocks("e") == n
            assert router.stats("e").connects == 1
            for other in (plain, intruder, anonymous):
                st = other.stats("e")
                assert st.batches == 0 and st.connects == 0, st
                assert other.index.num_blocks == 0
            assert intruder.stats("e").handshake_failures > 0
            assert anonymous.stats("e").handshake_failures > 0
        finally:
            for s in (plain, intruder, anonymous, router):
                s.close()

        # A raw replay request without keys gets no answer.
        ctx = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", pack_seq(0)))
        assert not dealer.poll(1500)
        dealer.close()


def test_without_an_allow_list_any_client_knowing_the_server_key_is_admitted(keys) -> None:
    with ZmqEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", curve_secret_key=str(keys["engine"])
    ) as pub:
        for i in range(3):
            pub.publish(_batch(i))
        assert pub.flush()
        anonymous = _subscriber(pub, None, keys["engine.pub"])
        plain = _subscriber(pub)
        try:
            assert anonymous.wait_for_seq("e", 2, timeout=15)
            _publish_for(pub, 1.0, 3)
            assert pub.flush()
            assert anonymous.wait_for_seq("e", pub.next_seq - 1, timeout=15)
            assert plain.stats("e").batches == 0  # no CURVE: no handshake
        finally:
            anonymous.close()
            plain.close()


def test_bad_key_files_are_clear_errors(keys, tmp_path: Path) -> None:
    with pytest.raises(CurveKeyError, match="secret"):
        ZmqEventPublisher("tcp://127.0.0.1:*", curve_secret_key=str(keys["engine.pub"]))
    with pytest.raises(CurveKeyError, match="cannot read"):
        ZmqEventPublisher("tcp://127.0.0.1:*", curve_secret_key=str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CurveKeyError, match="no \\*.key"):
        ZmqEventPublisher(
            "tcp://127.0.0.1:*",
            curve_secret_key=str(keys["engine"]),
            curve_allowed_clients=str(empty),
        )
    with pytest.raises(CurveKeyError, match="needs a CURVE secret key"):
        ZmqEventPublisher("tcp://127.0.0.1:*", curve_allowed_clients=str(keys["allowed"]))
    with pytest.raises(CurveKeyError, match="secret"):
        EventSubscriber(KVIndex(), curve_client_key=str(keys["router.pub"]))
    sub = EventSubscriber(KVIndex())
    with pytest.raises(CurveKeyError, match="cannot read"):
        sub.add_endpoint("e", "tcp://127.0.0.1:1", curve_server_key=str(tmp_path / "nope"))
    sub.close()
