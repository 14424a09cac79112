"""KV cache events: what a pool or tier holds changed (vLLM's wire format, specs/kv-events.md).

Owns the event types and their msgpack encoding. Producers (block pool, offload tiers) create
events; the engine drains them after each step and hands them to the publisher.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

# Media. vLLM uses "GPU" and "CPU", and "STORAGE" (with a locality) for tiers below host
# memory; our storage tiers publish "STORAGE" and name themselves in ``tier`` (an extra field
# that vLLM's decoder ignores): ``disk``/``fs``/``redis`` and, for a shared tier, its id
# (``fs:/mnt/kv``, ``redis://host:6379/0``), which is how a router learns which endpoints share
# it. DISK/FS/REDIS remain accepted from older publishers.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
MEDIUM_DISK = "DISK"
MEDIUM_FS = "FS"
MEDIUM_REDIS = "REDIS"


class KVCacheEvent(msgspec.Struct, array_like=False, omit_defaults=True, tag=True, kw_only=True):
    """Base of all events; ``tag=True`` adds the ``"type"`` key with the class name."""


class BlockStored(KVCacheEvent, kw_only=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str = "full_attention"
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None  # STORAGE: "LOCAL" | "REMOTE"
    tier: str | None = None  # STORAGE: which tier (kvserve extension)
    shared: bool = False  # STORAGE: the tier is shared between instances (kvserve extension)


class BlockRemoved(KVCacheEvent, kw_only=True):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int = 0
    locality: str | None = None
    tier: str | None = None
    shared: bool = False


class AllBlocksCleared(KVCacheEvent, kw_only=True):
    pass


AnyKVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    """``[ts, events]`` or ``[ts, events, data_parallel_rank]`` on the wire."""

    ts: float
    events: list[AnyKVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(
    events: list[AnyKVEvent], ts: float | None = None, data_parallel_rank: int | None = None
) -> bytes:
    """``data_parallel_rank``: the publishing rank of a data-parallel server (vLLM's third
    field; omitted when None)."""
    ts = time.time() if ts is None else ts
    return _encoder.encode(
        KVEventBatch(ts=ts, events=events, data_parallel_rank=data_parallel_rank)
    )


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload; raises ``msgspec.DecodeError`` on malformed input."""
    return _decoder.decode(payload)
