"""The TCP transport's messages and framing.

One pull per connection::

    consumer -> producer   PullRequest   (lease id, the consumer's model fingerprint and block
                                          size in bytes, block indices [start, end) of the lease,
                                          or several index ranges: KV cache groups)
    producer -> consumer   PullHeader    (ok or why not; per block: chain hash, xxh3-64 digest)
    producer -> consumer   raw bytes of the blocks, in index order, back to back
    consumer -> producer   PullDone      (how many leading blocks verified)

A message is a 4-byte big-endian length and a msgpack body. A pull of no blocks
(``start == end``, no ranges) only releases the lease (the decode side holds every block already).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import TypeVar

import msgspec

PROTOCOL_VERSION = 2  # 2: index ranges
MAX_MESSAGE_BYTES = 16 << 20  # a header of 100k blocks is ~5 MB

# Buffers per sendmsg / recvmsg_into call (the kernel's limit, at most 1024).
IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") else 16

IO_BATCH_BYTES = 4 << 20

_LEN = struct.Struct(">I")
T = TypeVar("T", bound=msgspec.Struct)


class PullRequest(msgspec.Struct, frozen=True):
    version: int
    lease_id: str
    fingerprint: str
    block_bytes: int
    start: int
    end: int
    ranges: list[tuple[int, int]] = []  # when given, the blocks asked for (start, end unused)

    def index_ranges(self) -> list[tuple[int, int]]:
        return list(self.ranges) if self.ranges else [(self.start, self.end)]


class PullHeader(msgspec.Struct, frozen=True):
    ok: bool
    error: str = ""
    block_bytes: int = 0
    hashes: list[bytes] = []
    digests: list[int] = []


class PullDone(msgspec.Struct, frozen=True):
    ok: bool
    good_blocks: int = 0
    error: str = ""


class TransferError(Exception):
    """A pull failed (connection, timeout, protocol, refused by the peer)."""


_encoder = msgspec.msgpack.Encoder()
_decoders = {t: msgspec.msgpack.Decoder(t) for t in (PullRequest, PullHeader, PullDone)}


def io_batch(views: list[memoryview], i: int, off: int) -> list[memoryview]:
    """The buffers of one system call from ``views[i]`` (byte ``off`` on): about
    :data:`IO_BATCH_BYTES` of them (a call moves at most what the socket buffer holds, and each
    buffer passed costs a lookup per call), at most :data:`IOV_MAX`."""
    batch = [views[i][off:] if off else views[i]]
    size = len(batch[0])
    j, end = i + 1, min(len(views), i + IOV_MAX)
    while j < end and size < IO_BATCH_BYTES:
        batch.append(views[j])
        size += len(views[j])
        j += 1
    return batch


def frame(msg: msgspec.Struct) -> bytes:
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


def send_msg(sock: socket.socket, msg: msgspec.Struct) -> None:
    sock.sendall(frame(msg))


def sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Send every buffer, in order, gathering up to :data:`IOV_MAX` of them per system call
    (runs of blocks scattered in the pool leave in few calls)."""
    i, off, n = 0, 0, len(views)
    while i < n:
        batch = io_batch(views, i, off)
        sent = sock.sendmsg(batch)
        while sent and i < n:
            rest = len(views[i]) - off
            if sent >= rest:
                sent -= rest
                i, off = i + 1, 0
            else:
                off, sent = off + sent, 0


def recv_msg(sock: socket.socket, kind: type[T], deadline: float) -> T:
    (n,) = _LEN.unpack(recv_bytes(sock, 4, deadline))
    if n > MAX_MESSAGE_BYTES:
        raise TransferError(f"message of {n} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return _decoders[kind].decode(recv_bytes(sock, n, deadline))
    except msgspec.DecodeError as e:
        raise TransferError(f"bad {kind.__name__}: {e}") from e


def recv_bytes(sock: socket.socket, n: int, deadline: float) -> bytearray:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), deadline)
    return buf


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: float) -> None:
    """Fill ``view`` from ``sock`` (each call bounded by the socket's timeout, the whole by
    ``deadline``, a ``time.monotonic()`` stamp)."""
    got, n = 0, len(view)
    while got < n:
        if time.monotonic() > deadline:
            raise TransferError(f"deadline passed after {got} of {n} bytes")
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise TransferError(f"connection closed after {got} of {n} bytes")
        got += k
