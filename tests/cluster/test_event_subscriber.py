"""Publisher -> subscriber -> index over real ZMQ sockets on loopback: in-order application,
gap -> replay, late join, lost batches, publisher restart, endpoint removal."""

from __future__ import annotations

import errno
import random
import time

import pytest
import zmq

from kvserve.cluster.event_subscriber import EventSubscriber
from kvserve.cluster.kv_index import KVIndex
from kvserve.kv.event_publisher import ZmqEventPublisher
from kvserve.kv.events import BlockRemoved, BlockStored

BS = 16


class Engine:
    """Publishes plausible event batches and remembers them (the oracle)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.batches: list[list] = []
        self.next_hash = seed * 1_000_000

    def stored_batch(self, n_blocks: int = 4) -> list:
        tokens = [self.rng.randrange(1000) for _ in range(n_blocks * BS)]
        hashes = list(range(self.next_hash, self.next_hash + n_blocks))
        self.next_hash += n_blocks
        ev = [
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=tokens,
                block_size=BS,
                medium="GPU",
            )
        ]
        if len(self.batches) % 3 == 2:  # now and then evict an older block
            ev.append(BlockRemoved(block_hashes=[hashes[0] - 5], medium="GPU"))
        self.batches.append(ev)
        return ev

    def padding_batch(self, n: int = 33000) -> list:
        """A ~100 KB batch the index skips at once (a sliding-window group's blocks): fills
        socket buffers without costing apply time."""
        ev = [
            BlockStored(
                block_hashes=[1],
                parent_block_hash=None,
                token_ids=[1000] * n,
                block_size=n,
                kv_cache_spec_kind="sliding_window",
            )
        ]
        self.batches.append(ev)
        return ev

    def oracle(self, upto: int | None = None) -> set[int]:
        idx = KVIndex()
        for ev in self.batches[: None if upto is None else upto + 1]:
            idx.apply_events("e", ev)
        return idx.endpoint_keys("e")


def publish(pub: ZmqEventPublisher, events: list) -> None:
    pub.publish(events)


@pytest.fixture
def subscriber():
    # A tiny receive queue, so a stalled subscriber really loses messages (production keeps
    # a deep one).
    sub = EventSubscriber(KVIndex(), replay_timeout=3.0, recv_hwm=2).start()
    yield sub
    sub.close()


def rebind(address: str, replay: str) -> ZmqEventPublisher:
    """A new publisher on the addresses of one just closed (zmq frees ports asynchronously)."""
    deadline = time.monotonic() + 5
    while True:
        try:
            return ZmqEventPublisher(address, replay)
        except zmq.ZMQError as e:
            if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def wait(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def connect(sub: EventSubscriber, pub: ZmqEventPublisher, eng: Engine, name: str = "e") -> None:
    """Subscribe, then publish until the subscriber has seen (and replayed) the stream and
    receives live batches."""
    sub.add_endpoint(name, pub.endpoint, pub.replay_endpoint)
    for _ in range(500):
        publish(pub, eng.stored_batch(1))
        assert pub.flush()
        if sub.wait_for_seq(name, pub.next_seq - 1, timeout=0.02):
            st = sub.stats(name)
            if st.batches > st.replayed_batches:
                return
    raise AssertionError("subscriber never caught up")


def test_in_order_application_and_late_join_replay(subscriber: EventSubscriber) -> None:
    eng = Engine(1)
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_size=1000) as pub:
        for _ in range(10):  # before anyone listens: only the replay buffer has these
            publish(pub, eng.stored_batch())
        assert pub.flush()
        connect(subscriber, pub, eng)
        for _ in range(30):
            publish(pub, eng.stored_batch())
        assert subscriber.wait_for_seq("e", len(eng.batches) - 1)
        st = subscriber.stats("e")
        assert st.missed_batches == 0 and st.replays >= 1 and st.gaps == 0
        assert subscriber.index.endpoint_keys("e") == eng.oracle()
        assert st.batches == len(eng.batches) and st.lag_s < 60


def test_gap_triggers_replay_and_index_matches_oracle(subscriber: EventSubscriber) -> None:
    eng = Engine(2)
    with ZmqEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_size=1000, send_hwm=1
    ) as pub:
        connect(subscriber, pub, eng)
        before = subscriber.stats("e").replays
        # Stall the subscriber (it blocks on the index lock) while ~70 MB are published:
        # more than loopback socket buffers hold (32 + 4 MB here), so ZMQ drops messages.
        with subscriber.index._lock:
            for i in range(700):
                publish(pub, eng.padding_batch() if i % 4 else eng.stored_batch())
            assert pub.flush(30)
        publish(pub, eng.stored_batch())
        assert subscriber.wait_for_seq("e", len(eng.batches) - 1, timeout=30)
        st = subscriber.stats("e")
        assert st.gaps >= 1 and st.replays > before
        assert st.missed_batches == 0
        assert subscriber.index.endpoint_keys("e") == eng.oracle()


def test_lost_batches_beyond_the_replay_buffer_are_counted(subscriber: EventSubscriber) -> None:
    eng = Engine(3)
    with ZmqEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_size=4, send_hwm=1
    ) as pub:
        connect(subscriber, pub, eng)
        with subscriber.index._lock:
            for i in range(700):
                publish(pub, eng.padding_batch() if i % 4 else eng.stored_batch())
            assert pub.flush(30)
        publish(pub, eng.stored_batch())
        assert subscriber.wait_for_seq("e", len(eng.batches) - 1, timeout=30)
        st = subscriber.stats("e")
        assert st.gaps >= 1 and st.missed_batches > 0
        # Everything indexed was published (nothing invented from the lost stream).
        ever = KVIndex(max_ghosts_per_endpoint=0)
        for ev in eng.batches:
            ever.apply_events("e", [e for e in ev if isinstance(e, BlockStored)])
        assert subscriber.index.endpoint_keys("e") <= ever.endpoint_keys("e")


def test_no_replay_socket_applies_after_gap(subscriber: EventSubscriber) -> None:
    eng = Engine(4)
    with ZmqEventPublisher("tcp://127.0.0.1:*") as pub:
        for _ in range(5):
            publish(pub, eng.stored_batch())
        pub.flush()
        subscriber.add_endpoint("e", pub.endpoint)
        assert wait(
            lambda: (
                (publish(pub, eng.stored_batch()) or True)
                and subscriber.stats("e") is not None
                and subscriber.stats("e").batches > 0
            ),
            timeout=10,
        )
        assert subscriber.wait_for_seq("e", pub.next_seq - 1)
        st = subscriber.stats("e")
        assert st.replays == 0
        # The 5 early batches were never seen; the rest were applied.
        assert subscriber.index.endpoint_keys("e") < eng.oracle()


def test_publisher_restart_clears_the_endpoint(subscriber: EventSubscriber) -> None:
    eng = Engine(5)
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    address, replay = pub.endpoint, pub.replay_endpoint
    connect(subscriber, pub, eng)
    for _ in range(5):
        publish(pub, eng.stored_batch())
    assert pub.flush()
    assert subscriber.wait_for_seq("e", pub.next_seq - 1)
    old = subscriber.index.endpoint_keys("e")
    assert old
    pub.close()
    time.sleep(0.2)
    eng2 = Engine(6)
    with rebind(address, replay) as pub2:  # same addresses, seq from 0 again
        assert wait(
            lambda: (
                (publish(pub2, eng2.stored_batch()) or True) and subscriber.stats("e").restarts >= 1
            ),
            timeout=15,
        )
        n = pub2.next_seq
        publish(pub2, eng2.stored_batch())
        assert subscriber.wait_for_seq("e", n)
        assert wait(lambda: subscriber.stats("e").last_seq == pub2.next_seq - 1)
        keys = subscriber.index.endpoint_keys("e")
        assert not keys & old  # the old instance's blocks are gone
        assert keys == eng2.oracle()  # replay from 0 filled in what the rejoin missed


def test_remove_endpoint_drops_it_from_the_index(subscriber: EventSubscriber) -> None:
    eng = Engine(7)
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        connect(subscriber, pub, eng)
        assert subscriber.index.endpoint_num_blocks("e") > 0
        subscriber.remove_endpoint("e")
        assert wait(lambda: subscriber.index.endpoint_num_blocks("e") == 0)
        assert subscriber.stats("e") is None
        publish(pub, eng.stored_batch())
        time.sleep(0.2)
        assert subscriber.index.endpoint_num_blocks("e") == 0


@pytest.mark.parametrize("ahead", [20, 1])
def test_restarted_publisher_past_our_seq_is_detected_by_replay(
    subscriber: EventSubscriber, ahead: int
) -> None:
    """A new publisher whose seq already passed ours looks like a gap (``ahead`` 20), or even
    like the next batch (``ahead`` 1: its first batch we see is exactly our seq + 1; the SUB
    socket's reconnect gives it away). Either way the replay of our last batch comes back
    different, so the endpoint is cleared and replayed from 0."""
    eng = Engine(8 + ahead)
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    address, replay = pub.endpoint, pub.replay_endpoint
    connect(subscriber, pub, eng)
    old = subscriber.index.endpoint_keys("e")
    last = subscriber.stats("e").last_seq
    pub.close()
    eng2 = Engine(9 + ahead)
    with rebind(address, replay) as pub2:
        for _ in range(last + ahead):  # before the subscriber can have reconnected
            publish(pub2, eng2.stored_batch())
        assert pub2.flush()
        assert wait(
            lambda: (
                (publish(pub2, eng2.stored_batch()) or pub2.flush())
                and subscriber.stats("e").restarts >= 1
            ),
            timeout=15,
        )
        assert pub2.flush()
        assert subscriber.wait_for_seq("e", pub2.next_seq - 1)
        keys = subscriber.index.endpoint_keys("e")
        assert not keys & old
        assert keys == eng2.oracle()


def test_idle_publisher_is_replayed_on_subscribe(subscriber: EventSubscriber) -> None:
    """A router (re)started in front of an idle engine: its index fills from the replay made
    on connecting, with no live batch to trigger it."""
    eng = Engine(20)
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        for _ in range(6):
            publish(pub, eng.stored_batch())
        assert pub.flush()
        subscriber.add_endpoint("e", pub.endpoint, pub.replay_endpoint)
        assert subscriber.wait_for_seq("e", pub.next_seq - 1, timeout=15)
        assert subscriber.index.endpoint_keys("e") == eng.oracle()
        st = subscriber.stats("e")
        assert st.connects == 1 and st.replays == 1 and st.batches == 6


@pytest.mark.parametrize("published", [0, 2, 12])
def test_idle_restarted_publisher_clears_its_endpoint(
    subscriber: EventSubscriber, published: int
) -> None:
    """An engine restarts and stays idle: the reconnection's replay disagrees with what we
    applied (nothing there, or a different batch), so its old blocks go at once; what the new
    one published before we reconnected (``published`` batches) is replayed."""
    eng = Engine(21)
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    address, replay = pub.endpoint, pub.replay_endpoint
    for _ in range(8):
        publish(pub, eng.stored_batch())
    assert pub.flush()
    subscriber.add_endpoint("e", address, replay)
    assert subscriber.wait_for_seq("e", 7, timeout=15)
    old = subscriber.index.endpoint_keys("e")
    assert old == eng.oracle()
    pub.close()
    eng2 = Engine(22)
    with rebind(address, replay) as pub2:
        for _ in range(published):
            publish(pub2, eng2.stored_batch())
        assert pub2.flush()
        assert wait(lambda: subscriber.stats("e").restarts == 1, timeout=15)
        assert wait(lambda: subscriber.index.endpoint_keys("e") == eng2.oracle(), timeout=15)
        assert subscriber.stats("e").last_seq == published - 1
        assert subscriber.stats("e").connects == 2


def test_reconnect_to_the_same_publisher_keeps_the_index(subscriber: EventSubscriber) -> None:
    """A dropped connection to a publisher that did not restart: verified, nothing cleared,
    batches published meanwhile replayed."""
    eng = Engine(23)
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        connect(subscriber, pub, eng)
        subscriber.remove_endpoint("e")
        assert wait(lambda: subscriber.stats("e") is None)
        subscriber.add_endpoint("e", pub.endpoint, pub.replay_endpoint)  # a fresh stream
        assert subscriber.wait_for_seq("e", pub.next_seq - 1, timeout=15)
        assert subscriber.index.endpoint_keys("e") == eng.oracle()
