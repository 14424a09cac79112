"""Router-side KV event intake: one ZMQ SUB stream per endpoint, in order, into the index.

Owns the sockets and per-stream sequence tracking. A jump in ``seq`` triggers a replay
request on the endpoint's replay socket (DEALER -> ROUTER, specs/kv-events.md); live batches
are held back until the replay ends so the index sees every stream in publish order. A seq
going backwards on the live stream means the publisher restarted: its endpoint is cleared.

Every time the SUB socket (re)connects (a completed handshake, seen on its monitor socket) the
stream is synced at once, without waiting for a live batch: an idle engine publishes
nothing, so a restarted router would otherwise stay empty and a restarted engine's old
blocks would stay indexed. A first connection replays from seq 0. A reconnection replays
from our last applied batch L (not L + 1) and compares it with the bytes we applied: the
publisher's buffer always holds its latest batch, so the same publisher answers with batch L
byte for byte (each payload carries its publication time), unless more than its buffer has
been published since (then the answer starts after L and continuity cannot be checked: the
lost batches are counted). A restarted publisher answers with nothing (it has published
fewer than L + 1 batches) or with a different batch L: the endpoint is cleared and replayed
from 0. This needs no identity on the wire, so it works with vLLM's publishers too. Without a
replay socket only a seq going back reveals a restart.
Runs on one background thread (sockets are owned by it); endpoints are added and removed
through a command queue whose wake-up pipe sits in the same poll as the sockets, so the
thread sleeps until a message, a command or a replay deadline: an idle subscriber never
takes the GIL from the router's event loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvserve.cluster.kv_index import KVIndex
from kvserve.kv.event_curve import CurveKeyPair, load_key_pair, load_public_key, make_client
from kvserve.kv.event_publisher import END_SEQ, pack_seq, unpack_seq
from kvserve.kv.events import decode_batch

logger = logging.getLogger(__name__)

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED
SYNC_TRIES = 3  # attempts of the replay made on (re)connection before giving up on it

# Called after each applied batch: (endpoint, seq, block events, lag seconds).
BatchHook = Callable[[str, int, int, float], None]


@dataclass
class StreamStats:
    last_seq: int = -1  # last applied seq (-1: none yet)
    batches: int = 0  # applied, live or replayed
    replayed_batches: int = 0  # of which came from replays
    block_events: int = 0
    gaps: int = 0  # seq jumps seen on the live stream
    replays: int = 0  # replay requests sent
    replay_failures: int = 0  # replays that timed out
    missed_batches: int = 0  # batches never received (not recoverable from replay)
    restarts: int = 0  # publisher restarts detected (seq went back, replay disagreed)
    connects: int = 0  # completed handshakes with the publisher (1 + reconnections)
    handshake_failures: int = 0  # e.g. CURVE keys the publisher refused
    malformed: int = 0  # undecodable messages (seq still advances)
    lag_s: float = 0.0  # now - batch timestamp, at the last applied batch
    last_batch_at: float = 0.0  # time.time() of the last applied batch


@dataclass
class _Stream:
    name: str
    address: str
    replay_address: str | None
    topic: bytes
    sub: zmq.Socket
    server_key: bytes | None = None  # the publisher's CURVE public key
    monitor: zmq.Socket | None = None  # handshake events of ``sub``
    dealer: zmq.Socket | None = None
    replaying: bool = False
    replay_got: int = 0  # messages received in the current replay
    sync_tries: int = 0  # attempts left of a sync replay (on connect) that times out
    last_live_seq: int = -1  # last seq received on the SUB socket
    last_payload: bytes | None = None  # payload of batch stats.last_seq (continuity check)
    verify_seq: int | None = None  # replay's first batch must equal last_payload
    replay_deadline: float = 0.0
    pending: list[tuple[int, bytes]] = field(default_factory=list)
    stale_pending: int = 0  # leading ``pending`` entries received before the last reconnect
    joined: bool = False  # a live batch came since the last (re)connection
    filling: bool = False  # the current replay fills a hole before the pending batches
    stats: StreamStats = field(default_factory=StreamStats)


class EventSubscriber:
    """Feeds a :class:`KVIndex` from the event streams of many endpoints."""

    def __init__(
        self,
        index: KVIndex,
        *,
        replay_timeout: float = 2.0,
        on_batch: BatchHook | None = None,
        recv_hwm: int = 100_000,
        curve_client_key: str | None = None,
        heartbeat_s: float = 5.0,
    ) -> None:
        """``curve_client_key``: our CURVE secret key file, used with endpoints added with a
        ``curve_server_key`` (without one they get a throwaway key pair). ``heartbeat_s``:
        ZMTP heartbeat period, so a publisher that vanished without closing its connections
        (a host gone) is reconnected to, and synced, when it comes back."""
        self.index = index
        self.replay_timeout = replay_timeout
        self.on_batch = on_batch
        self.recv_hwm = recv_hwm
        self.heartbeat_ms = int(heartbeat_s * 1000)
        self._curve_keys: CurveKeyPair | None = None
        if curve_client_key:
            self._curve_keys = load_key_pair(curve_client_key)
        self._ctx = zmq.Context.instance()
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._stats: dict[str, StreamStats] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._poller = zmq.Poller()  # used by the subscriber thread only
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._poller.register(self._wake_r, zmq.POLLIN)

    # ------------------------------------------------------------------ control (any thread)

    def start(self) -> EventSubscriber:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kv-event-sub", daemon=True)
            self._thread.start()
        return self

    def add_endpoint(
        self,
        name: str,
        address: str,
        replay_address: str | None = None,
        topic: str = "",
        *,
        curve_server_key: str | None = None,
    ) -> None:
        """Subscribe to ``address`` (e.g. ``tcp://10.0.0.1:5557``) for endpoint ``name``.

        ``curve_server_key``: the publisher's CURVE public key file (its events and replay
        sockets are CURVE servers); raises :class:`~kvserve.kv.event_curve.CurveKeyError`
        if it cannot be read.
        """
        server_key = load_public_key(curve_server_key) if curve_server_key else None
        if server_key is not None and self._curve_keys is None:
            self._curve_keys = CurveKeyPair.generate()
        self._commands.put(("add", name, address, replay_address, topic, server_key))
        self._wake()

    def remove_endpoint(self, name: str) -> None:
        """Unsubscribe and drop the endpoint from the index."""
        self._commands.put(("remove", name))
        self._wake()

    def close(self) -> None:
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(5)
            if self._thread.is_alive():
                return  # stuck: leave its pipe open rather than have it poll a reused fd
            self._thread = None
        if self._wake_w >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    def _wake(self) -> None:
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):  # a full pipe wakes it already
                os.write(self._wake_w, b"\0")

    def stats(self, name: str) -> StreamStats | None:
        s = self._stats.get(name)
        return dataclasses.replace(s) if s is not None else None

    def all_stats(self) -> dict[str, StreamStats]:
        return {n: dataclasses.replace(s) for n, s in list(self._stats.items())}

    def wait_for_seq(self, name: str, seq: int, timeout: float = 5.0) -> bool:
        """Block until endpoint ``name`` has applied batch ``seq`` (tests, tools)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                s = self._stats.get(name)
                if s is not None and s.last_seq >= seq:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)

    # ------------------------------------------------------------------ subscriber thread

    def _run(self) -> None:
        poller = self._poller
        try:
            while not self._stop.is_set():
                if self._do_commands():
                    continue
                events = dict(poller.poll(self._poll_timeout_ms()))
                if events.get(self._wake_r):
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                for st in list(self._streams.values()):
                    if st.monitor is not None and events.get(st.monitor):
                        self._drain_monitor(st)
                    if st.dealer is not None and events.get(st.dealer):
                        self._drain_replay(st)
                    if events.get(st.sub):
                        self._drain_live(st)
                    if st.replaying and time.monotonic() > st.replay_deadline:
                        logger.warning("KV event replay from %s timed out", st.name)
                        st.stats.replay_failures += 1
                        self._close_dealer(st)
                        if st.sync_tries > 0:  # a sync on connect: worth another try
                            self._retry_sync(st)
                        else:
                            self._finish_replay(st, failed=True)
                    elif not st.replaying and st.dealer is not None:
                        self._close_dealer(st)
        finally:
            for st in self._streams.values():
                if st.monitor is not None:
                    st.monitor.close(linger=0)
                st.sub.close(linger=0)
                if st.dealer is not None:
                    st.dealer.close(linger=0)
            self._streams.clear()

    def _poll_timeout_ms(self) -> int | None:
        """Until the nearest replay deadline; ``None`` (no timeout) when none is pending."""
        deadlines = [st.replay_deadline for st in self._streams.values() if st.replaying]
        if not deadlines:
            return None
        return max(1, int(1000 * (min(deadlines) - time.monotonic())) + 1)

    def _do_commands(self) -> bool:
        did = False
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return did
            did = True
            self._do_command(cmd)

    def _do_command(self, cmd: tuple) -> None:
        if cmd[0] == "remove":
            self._drop_stream(cmd[1])
            self._stats.pop(cmd[1], None)
            self.index.remove_endpoint(cmd[1])
            return
        _, name, address, replay_address, topic, server_key = cmd
        if name in self._streams:  # re-added (changed address): start over
            self._drop_stream(name)
            self.index.clear_endpoint(name)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.recv_hwm)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        if self.heartbeat_ms > 0:
            sub.setsockopt(zmq.HEARTBEAT_IVL, self.heartbeat_ms)
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * self.heartbeat_ms)
        if server_key is not None:
            assert self._curve_keys is not None
            make_client(sub, self._curve_keys, server_key)
        monitor = sub.get_monitor_socket(_HANDSHAKE_EVENTS)  # before connect: see the first
        try:
            sub.connect(address)
        except zmq.ZMQError as e:
            logger.error("cannot subscribe to KV events of %s at %s: %s", name, address, e)
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            return
        st = _Stream(name, address, replay_address, topic.encode("utf-8"), sub)
        st.server_key = server_key
        st.monitor = monitor
        self._streams[name] = st
        self._stats[name] = st.stats
        self._poller.register(sub, zmq.POLLIN)
        self._poller.register(st.monitor, zmq.POLLIN)

    def _drop_stream(self, name: str) -> None:
        st = self._streams.pop(name, None)
        if st is None:
            return
        self._poller.unregister(st.sub)
        if st.monitor is not None:
            self._poller.unregister(st.monitor)
            st.sub.disable_monitor()
            st.monitor.close(linger=0)
        st.sub.close(linger=0)
        self._close_dealer(st)

    def _close_dealer(self, st: _Stream) -> None:
        if st.dealer is not None:
            self._poller.unregister(st.dealer)
            st.dealer.close(linger=0)  # drops replies of a timed-out replay
            st.dealer = None

    def _drain_monitor(self, st: _Stream) -> None:
        assert st.monitor is not None
        while True:
            try:
                event = recv_monitor_message(st.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                st.stats.connects += 1
                self._sync(st)
            elif event["event"] & _HANDSHAKE_FAILED:
                st.stats.handshake_failures += 1
                n = st.stats.handshake_failures
                if n in (1, 10) or n % 1000 == 0:  # zmq retries every 100 ms: log a few
                    logger.warning(
                        "KV events of %s: handshake with %s failed (%d times; CURVE keys?)",
                        st.name,
                        st.address,
                        n,
                    )

    def _sync(self, st: _Stream) -> None:
        """(Re)connected: replay at once, from 0 or from our last batch to verify it (an
        idle publisher would otherwise leave us empty, or stale after its restart)."""
        if st.replay_address is None:
            return
        self._close_dealer(st)  # a replay in flight may be talking to the old publisher
        st.stale_pending = len(st.pending)  # received before: the old publisher's, maybe
        st.joined = False
        last = st.stats.last_seq
        self._start_replay(st, max(last, 0), verify=last >= 0)
        st.sync_tries = SYNC_TRIES - 1

    def _retry_sync(self, st: _Stream) -> None:
        tries = st.sync_tries - 1
        if st.verify_seq is not None:
            self._start_replay(st, st.verify_seq, verify=True)
        else:
            self._start_replay(st, max(st.stats.last_seq, 0), verify=False)
        st.sync_tries = tries

    def _drain_live(self, st: _Stream, budget: int = 512) -> None:
        for _ in range(budget):
            try:
                frames = st.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                st.stats.malformed += 1
                continue
            self._on_live(st, unpack_seq(frames[1]), frames[2])

    def _on_live(self, st: _Stream, seq: int, payload: bytes) -> None:
        # One publisher's live seqs only grow: going back means a new publisher (restart).
        if st.last_live_seq >= 0 and seq <= st.last_live_seq:
            self._restarted(st, f"seq {seq} after {st.last_live_seq}", keep_pending=False)
        st.last_live_seq = seq
        joined, st.joined = st.joined, True
        if st.replaying:
            st.pending.append((seq, payload))
            return
        last = st.stats.last_seq
        if seq <= last:
            return  # already applied from a replay
        if seq == last + 1:
            self._apply(st, seq, payload)
            return
        if last >= 0 and seq != last + 1 and joined:
            # (The first live batch after a (re)connection is where we joined, not a gap:
            # a publisher drops batches until our subscription reaches it.)
            st.stats.gaps += 1
        if st.replay_address:
            # Replay from the last applied batch, not the one after: getting the same bytes
            # back proves it is still the same publisher (a restarted one may have passed
            # our seq already, which a seq check alone would take for a mere gap).
            st.pending.append((seq, payload))
            self._start_replay(st, last if last >= 0 else 0, verify=last >= 0)
        else:
            if last >= 0:
                st.stats.missed_batches += seq - last - 1
            self._apply(st, seq, payload)

    def _restarted(self, st: _Stream, why: str, keep_pending: bool = True) -> None:
        """A new publisher: forget the old one's blocks, then replay the new one from 0."""
        logger.warning("KV event stream of %s restarted (%s): endpoint cleared", st.name, why)
        st.stats.restarts += 1
        self.index.clear_endpoint(st.name)
        st.last_payload = None
        st.last_live_seq = -1
        with self._cond:
            st.stats.last_seq = -1
        if st.replaying:
            self._close_dealer(st)  # drop the rest of the old replay
            st.replaying = False
        # Live batches received before the reconnection that revealed the restart (or all,
        # when a live seq did) are the old publisher's.
        st.pending = st.pending[st.stale_pending :] if keep_pending else []
        st.stale_pending = 0
        if st.replay_address is not None:
            self._start_replay(st, 0, verify=False)

    def _start_replay(self, st: _Stream, start: int, verify: bool) -> None:
        if st.dealer is None:
            st.dealer = self._ctx.socket(zmq.DEALER)
            st.dealer.setsockopt(zmq.LINGER, 0)
            if st.server_key is not None:
                assert self._curve_keys is not None
                make_client(st.dealer, self._curve_keys, st.server_key)
            st.dealer.connect(st.replay_address)
            self._poller.register(st.dealer, zmq.POLLIN)
        st.dealer.send_multipart((b"", pack_seq(start)))
        st.replaying = True
        st.replay_got = 0
        st.sync_tries = 0
        st.filling = False
        st.verify_seq = start if verify else None
        st.replay_deadline = time.monotonic() + self.replay_timeout
        st.stats.replays += 1

    def _drain_replay(self, st: _Stream, budget: int = 4096) -> None:
        for _ in range(budget):
            if st.dealer is None:
                return
            try:
                frames = st.dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # [b"", topic, seq, payload]
            if len(frames) != 4 or len(frames[2]) != 8:
                st.stats.malformed += 1
                continue
            seq = unpack_seq(frames[2])
            if not st.replaying:
                continue
            if seq == END_SEQ:
                if st.verify_seq is not None and st.replay_got == 0:
                    # The same publisher still holds its latest batch, whose seq is at least
                    # our last: nothing from there on means a new, younger publisher.
                    self._restarted(st, f"no batch from {st.verify_seq} on")
                    return
                self._finish_replay(st)
                return
            st.replay_got += 1
            if st.verify_seq is not None:
                check, st.verify_seq = st.verify_seq, None
                if seq == check:
                    if frames[3] != st.last_payload:
                        self._restarted(st, f"batch {seq} differs from the one applied")
                        return
                    continue
                # The buffer no longer holds our last batch: continuity cannot be checked.
            if seq <= st.stats.last_seq:
                continue
            if st.stats.last_seq >= 0 and seq > st.stats.last_seq + 1:
                # Older batches than the buffer still holds: lost.
                st.stats.missed_batches += seq - st.stats.last_seq - 1
            self._apply(st, seq, frames[3])
            st.stats.replayed_batches += 1

    def _finish_replay(self, st: _Stream, *, failed: bool = False) -> None:
        filled, st.filling = st.filling, False
        st.replaying = False
        st.verify_seq = None
        st.stale_pending = 0
        if not failed and not filled and st.pending and st.pending[0][0] > st.stats.last_seq + 1:
            # Batches published after the publisher answered and before our subscription
            # reached it were dropped by its PUB socket: fetch the hole, once.
            self._start_replay(st, st.stats.last_seq + 1, verify=False)
            st.filling = True
            return
        pending, st.pending = st.pending, []
        for seq, payload in pending:
            last = st.stats.last_seq
            if seq <= last:
                continue
            if last >= 0 and seq > last + 1:
                st.stats.missed_batches += seq - last - 1
            self._apply(st, seq, payload)

    def _apply(self, st: _Stream, seq: int, payload: bytes) -> None:
        n = 0
        lag = 0.0
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            st.stats.malformed += 1
            logger.warning("undecodable KV event batch %d from %s: %s", seq, st.name, e)
        else:
            n = self.index.apply_events(st.name, batch.events)
            now = time.time()
            lag = max(0.0, now - batch.ts)
            st.stats.lag_s = lag
            st.stats.last_batch_at = now
        st.last_payload = payload
        st.stats.batches += 1
        st.stats.block_events += n
        with self._cond:
            st.stats.last_seq = seq
            self._cond.notify_all()
        if self.on_batch is not None:
            self.on_batch(st.name, seq, n, lag)
