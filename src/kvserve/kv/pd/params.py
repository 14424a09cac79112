"""``kv_transfer_params``: vLLM's prefill/decode contract, as the pd connector reads and writes it.

Prefill leg, request: ``{"do_remote_decode": true}`` (with ``max_tokens=1``). Its response
carries the parameters of the decode leg, which the caller sends back unchanged::

    {"do_remote_prefill": true, "do_remote_decode": false,
     "remote_engine_id": ..., "remote_host": ..., "remote_port": ...,
     "remote_request_id": <lease id>, "remote_block_ids": [...full blocks only...],
     "remote_block_size": 16, "remote_num_tokens": <tokens in those blocks>,
     "remote_kv_fingerprint": <model + hash seed + KV layout>,
     "remote_last_block_hash": <hex of the chain hash of the last block>}

With KV cache groups (a hybrid model, e.g. Gemma 3's sliding-window and full-attention
layers), ``remote_block_ids`` is a list per group, as vLLM's NixlConnector writes it for its
hybrid allocator: a full-attention group's every block, a sliding-window group's only the blocks
of its window before the end of ``remote_num_tokens`` (the blocks before it are already freed:
vLLM leaves its null blocks out the same way); ``remote_num_tokens`` then counts the prompt
blocks covered.

The first eight are vLLM's (NixlConnector) names; the last two are kvserve's: a decode engine
refuses blocks of another model, layout or hash seed, or of another prompt or tenant (the chain
hash commits to every token and the cache salt), before it pulls anything. The lease id is a
random 128-bit secret: only the holder of a response can pull its blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.engine.request import Request

MAX_LEASE_ID_CHARS = 256


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode request's KV is: the parsed ``do_remote_prefill`` parameters."""

    engine_id: str
    host: str
    port: int
    lease_id: str
    block_ids: list[int]  # one group's blocks (the first group's with groups)
    block_size: int
    num_tokens: int
    fingerprint: str
    last_block_hash: bytes
    # Per KV cache group (None: one group): the group's blocks, the last ``len`` of the
    # ``num_blocks`` prompt blocks (a sliding group's window, a full group's every block).
    group_block_ids: list[list[int]] | None = None

    @property
    def num_blocks(self) -> int:
        if self.group_block_ids is not None:
            return self.num_tokens // self.block_size
        return len(self.block_ids)

    def usable_blocks(
        self, block_hashes: Sequence[bytes], fingerprint: str, block_size: int
    ) -> tuple[int, str]:
        """How many of these blocks a decode request (its ``block_hashes``) on an engine with
        ``fingerprint`` and ``block_size`` can use: all of them, or 0 and why not."""
        n = self.num_blocks
        if self.fingerprint != fingerprint:
            return 0, f"model fingerprint {self.fingerprint} is not ours ({fingerprint})"
        if self.block_size != block_size:
            return 0, f"block size {self.block_size} is not ours ({block_size})"
        if self.group_block_ids is not None and any(len(g) > n for g in self.group_block_ids):
            return 0, f"a group holds more blocks than the {n} remote prompt blocks"
        if n > len(block_hashes):
            return 0, f"{n} remote blocks for a prompt of {len(block_hashes)} full blocks"
        if n and block_hashes[n - 1] != self.last_block_hash:
            return 0, "the remote blocks hold another prompt (chain hash differs)"
        return n, ""


def offered_blocks(request: Request, block_ids: Sequence[int], block_size: int) -> int:
    """Full prompt blocks a finished prefill (``request``, holding ``block_ids``) offers to
    its decode leg."""
    n = min(request.num_computed_tokens, request.num_prompt_tokens) // block_size
    return min(n, len(block_ids), len(request.block_hashes))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_block_ids(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(b) and b >= 0 for b in v)


def _check_type(params: dict[str, Any], key: str, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"kv_transfer_params.{key} must be {what}, got {params[key]!r:.80}")


def check(params: dict[str, Any]) -> None:
    """Type-check the fields kvserve reads (ValueError: the request is refused). Fields of
    other implementations are ignored, as are missing ones (the request then recomputes)."""
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be an object")
    for key in ("do_remote_decode", "do_remote_prefill"):
        if key in params and params[key] is not None:
            _check_type(params, key, isinstance(params[key], bool), "a boolean")
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill exclude")
    for key in ("remote_engine_id", "remote_host", "remote_kv_fingerprint"):
        if params.get(key) is not None:
            _check_type(params, key, isinstance(params[key], str), "a string")
    lease = params.get("remote_request_id")
    if lease is not None:
        ok = isinstance(lease, str) and 0 < len(lease) <= MAX_LEASE_ID_CHARS
        _check_type(params, "remote_request_id", ok, f"a string of 1-{MAX_LEASE_ID_CHARS} chars")
    port = params.get("remote_port")
    if port is not None:
        _check_type(params, "remote_port", _is_int(port) and 0 < port < 65536, "a TCP port")
    for key, lo in (("remote_block_size", 1), ("remote_num_tokens", 0)):
        v = params.get(key)
        if v is not None:
            _check_type(params, key, _is_int(v) and v >= lo, f"an integer >= {lo}")
    ids = params.get("remote_block_ids")
    if ids is not None:
        ok = isinstance(ids, list) and (
            all(_is_block_ids(g) for g in ids) if ids and isinstance(ids[0], list)
            else _is_block_ids(ids)
        )  # fmt: skip
        _check_type(params, "remote_block_ids", ok, "a list of block ids (or one per group)")
    h = params.get("remote_last_block_hash")
    if h is not None:
        ok = isinstance(h, str) and len(h) == 64
        if ok:
            try:
                bytes.fromhex(h)
            except ValueError:
                ok = False
        _check_type(params, "remote_last_block_hash", ok, "64 hex digits")


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return bool(params) and params.get("do_remote_decode") is True


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    return bool(params) and params.get("do_remote_prefill") is True


def parse_remote_prefill(params: dict[str, Any] | None) -> RemotePrefill | None:
    """The decode leg's source, or None when the request is not one or lacks what kvserve's
    transport needs (parameters of another implementation: the request recomputes).
    ``params`` passed :func:`check` at admission."""
    if not wants_remote_prefill(params):
        return None
    assert params is not None
    need = (
        "remote_host",
        "remote_port",
        "remote_request_id",
        "remote_block_ids",
        "remote_block_size",
        "remote_kv_fingerprint",
    )
    if any(params.get(k) is None for k in need):
        return None
    ids = list(params["remote_block_ids"])
    groups: list[list[int]] | None = None
    if ids and isinstance(ids[0], list):
        if params.get("remote_num_tokens") is None:
            return None  # per-group blocks name the prompt blocks they cover by it
        groups = [list(g) for g in ids]
        ids = groups[0]
    h = params.get("remote_last_block_hash")
    if (ids or groups) and h is None:
        return None
    return RemotePrefill(
        engine_id=str(params.get("remote_engine_id") or ""),
        host=params["remote_host"],
        port=params["remote_port"],
        lease_id=params["remote_request_id"],
        block_ids=ids,
        block_size=params["remote_block_size"],
        num_tokens=params.get("remote_num_tokens") or len(ids) * params["remote_block_size"],
        fingerprint=params["remote_kv_fingerprint"],
        last_block_hash=bytes.fromhex(h) if h else b"",
        group_block_ids=groups,
    )


def decode_leg_params(
    *,
    engine_id: str,
    host: str,
    port: int,
    lease_id: str,
    block_ids: list[int] | list[list[int]],
    block_size: int,
    fingerprint: str,
    last_block_hash: bytes | None,
    num_blocks: int | None = None,
) -> dict[str, Any]:
    """What a finished prefill returns: the decode leg's ``kv_transfer_params``
    (``block_ids`` per group, covering ``num_blocks`` prompt blocks, with KV cache groups)."""
    if num_blocks is None:
        num_blocks = len(block_ids)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_host": host,
        "remote_port": port,
        "remote_request_id": lease_id,
        "remote_block_ids": [list(g) if isinstance(g, list) else g for g in block_ids],
        "remote_block_size": block_size,
        "remote_num_tokens": num_blocks * block_size,
        "remote_kv_fingerprint": fingerprint,
        "remote_last_block_hash": last_block_hash.hex() if last_block_hash else None,
    }
