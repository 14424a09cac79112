"""ZMQ CURVE for the KV event sockets: key files, and applying them to sockets.

KV events carry prompt token ids. CURVE encrypts the event (PUB/SUB) and replay
(ROUTER/DEALER) connections and, with an allow-list, admits only known subscribers. Keys are
files in ZeroMQ's certificate format (``zmq.auth.create_certificates(dir, name)`` writes
``name.key`` with the public key and ``name.key_secret`` with both):

- the engine (server side) holds a secret key file and, optionally, a directory of the
  public key files of the subscribers it admits (without one, any subscriber that knows the
  engine's public key is admitted: the connection is still encrypted);
- a subscriber (client side) holds the engine's public key file and its own secret key file
  (or none: it then makes a throwaway key pair, enough for an engine without an allow-list).

Owns no sockets; the publisher and the router's subscriber call it.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import zmq
import zmq.auth


class CurveKeyError(ValueError):
    """A CURVE key file or directory that cannot be used (the message names it)."""


def require_curve() -> None:
    if not zmq.has("curve"):
        raise CurveKeyError("this libzmq was built without CURVE support (zmq.has('curve'))")


@dataclass(frozen=True)
class CurveKeyPair:
    public: bytes  # Z85, 40 bytes
    secret: bytes

    @classmethod
    def generate(cls) -> CurveKeyPair:
        require_curve()
        public, secret = zmq.curve_keypair()
        return cls(public, secret)


def _load(path: str) -> tuple[bytes, bytes | None]:
    require_curve()
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise CurveKeyError(f"cannot read CURVE key file {path}: {e}") from None
    if not public or len(public) != 40:
        raise CurveKeyError(f"{path}: no CURVE public key in it (ZeroMQ certificate format)")
    return public, secret


def load_key_pair(path: str) -> CurveKeyPair:
    """A secret key file (``*.key_secret``): this side's own key pair."""
    public, secret = _load(path)
    if not secret or len(secret) != 40:
        raise CurveKeyError(f"{path}: no CURVE secret key in it (give the .key_secret file)")
    return CurveKeyPair(public, secret)


def load_public_key(path: str) -> bytes:
    """The public key of a key file (``*.key`` or ``*.key_secret``): the peer's identity."""
    return _load(path)[0]


def check_allowed_clients(directory: str) -> int:
    """Number of public key files (``*.key``) in an allow-list directory; raises if none."""
    if not os.path.isdir(directory):
        raise CurveKeyError(f"CURVE allowed-clients directory {directory} does not exist")
    files = glob.glob(os.path.join(directory, "*.key"))
    if not files:
        raise CurveKeyError(f"CURVE allowed-clients directory {directory} has no *.key file")
    for f in files:
        load_public_key(f)
    return len(files)


def check_server_keys(secret_key: str | None, allowed_clients: str | None) -> None:
    """Validate a publisher's key options (at startup, before anything is built)."""
    if allowed_clients and not secret_key:
        raise CurveKeyError("a CURVE allowed-clients directory needs a CURVE secret key")
    if secret_key:
        load_key_pair(secret_key)
    if allowed_clients:
        check_allowed_clients(allowed_clients)


def make_server(sock: zmq.Socket, keys: CurveKeyPair) -> None:
    """Make ``sock`` (PUB, ROUTER) a CURVE server; call before bind."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def make_client(sock: zmq.Socket, keys: CurveKeyPair, server_key: bytes) -> None:
    """Make ``sock`` (SUB, DEALER) a CURVE client of the server ``server_key``; before
    connect."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_key
