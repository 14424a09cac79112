"""The TCP transport's messages and framing.

One pull per connection::

    consumer -> producer   PullRequest   (lease id, the consumer's model fingerprint and block
                                          size in bytes, block indices [start, end) of the lease)
    producer -> consumer   PullHeader    (ok or why not; per block: chain hash, xxh3-64 digest)
    producer -> consumer   raw bytes of the blocks, in index order, back to back
    consumer -> producer   PullDone      (how many leading blocks verified)

A message is a 4-byte big-endian length and a msgpack body. A pull of no blocks
(``start == end``) only releases the lease (the decode side holds every block already).
"""

from __future__ import annotations

import socket
import struct
import time
from typing import TypeVar

import msgspec

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 16 << 20  # a header of 100k blocks is ~5 MB

_LEN = struct.Struct(">I")
T = TypeVar("T", bound=msgspec.Struct)


class PullRequest(msgspec.Struct, frozen=True):
    version: int
    lease_id: str
    fingerprint: str
    block_bytes: int
    start: int
    end: int


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


def send_msg(sock: socket.socket, msg: msgspec.Struct) -> None:
    body = _encoder.encode(msg)
    sock.sendall(_LEN.pack(len(body)) + body)


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
