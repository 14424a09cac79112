"""Engine-side KV event publisher: ZMQ PUB stream plus a replay ROUTER (specs/kv-events.md).

Owns the sockets, the sequence numbers and the bounded replay buffer. The engine calls
:meth:`ZmqEventPublisher.publish` after each step; encoding and sending happen on the
publisher's own thread, so publishing never blocks a step (the hand-off is a queue put).
It does not know what the events mean: producers (block pool, tiers) create them.

Events carry prompt token ids: bind these sockets on a private network only, and/or give a
CURVE secret key (``curve_secret_key``; :mod:`kvserve.kv.event_curve`) to encrypt both
sockets, with ``curve_allowed_clients`` (a directory of public key files) to admit only those
subscribers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from kvserve.kv.event_curve import CurveKeyPair, check_server_keys, load_key_pair, make_server
from kvserve.kv.events import AnyKVEvent, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = -1  # seq of the replay end marker


def pack_seq(seq: int) -> bytes:
    """8-byte big-endian signed sequence number."""
    return seq.to_bytes(8, "big", signed=True)


def unpack_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


_CLOSE = object()


class ZmqEventPublisher:
    """Publishes KV event batches as ``[topic, seq, payload]`` and serves replays.

    ``endpoint`` (and ``replay_endpoint``) are ZMQ addresses to bind, e.g. ``tcp://*:5557``;
    a port of ``*`` binds a free port, readable afterwards from :attr:`endpoint`.
    Sequence numbers start at 0 and grow by one per published batch; the last
    ``buffer_size`` batches are kept for replay.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_size: int = 10000,
        *,
        max_queue: int = 100_000,
        send_hwm: int = 100_000,
        curve_secret_key: str | None = None,
        curve_allowed_clients: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> None:
        if buffer_size < 1:
            raise ValueError("buffer_size must be >= 1")
        check_server_keys(curve_secret_key, curve_allowed_clients)
        self._curve: CurveKeyPair | None = None
        self._auth = None
        if curve_secret_key:
            self._curve = load_key_pair(curve_secret_key)
            # A context of our own: its ZAP handler (the allow-list) is per context.
            self._ctx = zmq.Context()
            if curve_allowed_clients:
                from zmq.auth.thread import ThreadAuthenticator

                self._auth = ThreadAuthenticator(self._ctx, log=logger)
                self._auth.start()
                self._auth.configure_curve(domain="*", location=curve_allowed_clients)
        else:
            self._ctx = zmq.Context.instance()
        self.topic = topic.encode("utf-8")
        self.data_parallel_rank = data_parallel_rank  # set in every batch (a DP rank's events)
        self.buffer_size = buffer_size
        self._requested = (endpoint, replay_endpoint)
        self._send_hwm = send_hwm
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)
        self._next_seq = 0
        self._dropped = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        # The thread sleeps in one poll over this pipe and the replay socket: no periodic wakeups.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.endpoint: str = endpoint
        self.replay_endpoint: str | None = replay_endpoint
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            self._close_context()
            raise self._error

    # ------------------------------------------------------------------ engine-facing API

    def publish(self, events: Sequence[AnyKVEvent]) -> None:
        """Queue one batch (an empty list publishes nothing). Never blocks."""
        if not events or self._closed:
            return
        try:
            self._queue.put_nowait((time.time(), list(events)))
            self._wake()
        except queue.Full:
            # Seqs are assigned when sending, so subscribers cannot see this loss: log it.
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 1000 == 0:
                logger.error("KV event queue full: %d batches dropped", self._dropped)

    @property
    def next_seq(self) -> int:
        """Sequence number the next sent batch will get."""
        return self._next_seq

    @property
    def dropped_batches(self) -> int:
        return self._dropped

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch has been sent; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.001)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets and stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_CLOSE)
        self._wake()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._close_context()

    def _close_context(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._curve is not None:
            self._ctx.term()  # our own context (sockets are closed by now)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe already means "wake up"
            os.write(self._wake_w, b"\0")

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ publisher thread

    def _run(self) -> None:
        pub = replay = None
        try:
            endpoint, replay_endpoint = self._requested
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self._send_hwm)
            pub.setsockopt(zmq.LINGER, 500)
            if self._curve is not None:
                make_server(pub, self._curve)
            pub.bind(endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if replay_endpoint:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                if self._curve is not None:
                    make_server(replay, self._curve)
                replay.bind(replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException as e:  # surfaced to the constructor
            self._error = e
            for s in (pub, replay):
                if s is not None:
                    s.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        try:
            while True:
                poller.poll()
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 65536)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
                # Send everything queued before looking at replay requests.
                while item is not None:
                    if item is _CLOSE:
                        self._queue.task_done()
                        return
                    try:
                        self._send(pub, *item)
                    finally:
                        self._queue.task_done()
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        item = None
                if replay is not None:
                    self._serve_replays(replay)
        finally:
            pub.close()
            if replay is not None:
                replay.close(linger=0)

    def _send(self, pub: zmq.Socket, ts: float, events: list[AnyKVEvent]) -> None:
        try:
            payload = encode_batch(events, ts=ts, data_parallel_rank=self.data_parallel_rank)
        except Exception:
            logger.exception("could not encode a KV event batch; dropped")
            return
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        pub.send_multipart((self.topic, pack_seq(seq), payload), copy=False)

    def _serve_replays(self, sock: zmq.Socket) -> None:
        while sock.poll(0):
            frames = sock.recv_multipart()
            # [identity, b"", start_seq]
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                logger.warning("malformed KV replay request (%d frames) ignored", len(frames))
                continue
            identity = frames[0]
            start = unpack_seq(frames[2])
            for seq, payload in list(self._buffer):
                if seq >= start:
                    sock.send_multipart((identity, b"", self.topic, pack_seq(seq), payload))
            sock.send_multipart((identity, b"", b"", pack_seq(END_SEQ), b""))
