"""The stored form of one KV chunk below host memory: a fixed binary header, then the payload.

Owns the byte layout every storage tier writes (disk slots, shared-FS files, Redis values) and
its verification on read. Header (little-endian, :data:`HEADER_BYTES` long, zero padded)::

    magic "KVSC" | format version u16 | layout length u16 | payload length u64
    | xxh3-128 of the payload (16 bytes) | chunk key (32 bytes) | model fingerprint (16 ASCII)
    | layout description (ASCII, ``ChunkLayout.describe()``)

A read is accepted only when every field matches what the reader expects (same format version,
model fingerprint, layout, key, payload length) and the payload's full-content hash matches:
tiers shared between processes are written by others, so nothing is sampled here (the host
tier's sampled checksum guards slots only this process writes). xxh3-128 runs at memory speed
(~10 GB/s a core), a fraction of any storage medium's bandwidth. No pickle: the format is plain
bytes, readable by any language.

The model fingerprint names the weights, not only the directory: config, tokenizer and sampled
content of every weight file, with the hash seed, so two instances share KV only when they would
compute the same KV (see :func:`fingerprint_model_dir`).

KV cache groups (hybrid models): a chunk holds one group's layers. The header's key is the
group's (:func:`group_chunk_key`), so a chunk of group 2 never reads as group 3's, and the
fingerprint of an engine with groups also names its grouping (:func:`kv_groups_identity`), so
no chunk reads as another grouping's or as an every-layer chunk.
"""

from __future__ import annotations

import functools
import hashlib
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

MAGIC = b"KVSC"
# Bump when the stored byte layout or the meaning of a header field changes.
STORAGE_FORMAT_VERSION = 1
HEADER_BYTES = 256
_FIXED = struct.Struct(
    "<4sHHQ16s32s16s"
)  # magic, version, layout len, payload len, hash, key, model
_MAX_LAYOUT = HEADER_BYTES - _FIXED.size
_DIGEST_AT = 16  # offset of the payload hash (after magic, version, layout len, payload len)
_KEY_AT = _DIGEST_AT + 16


def group_chunk_key(key: bytes, group_idx: int) -> bytes:
    """The key of a chunk of KV cache group ``group_idx`` (hybrid models keep one chunk per
    group and prefix chunk): group 0's is the chunk key itself (models with one group store
    what they always did), another group's a SHA-256 of the group and the key, so every tier,
    header and event tells the groups apart."""
    if group_idx == 0:
        return key
    return hashlib.sha256(b"kvserve-kv-group:%d:" % group_idx + key).digest()


def kv_groups_identity(groups: Sequence[Any]) -> str:
    """Names a model's KV cache groups (``KVCacheGroupSpec``: attention kind, window, layers)
    for the fingerprint: engines share a group's chunks only when they group alike."""
    parts = [
        f"{g.spec.kind}:{g.spec.sliding_window}:{','.join(map(str, g.layer_ids))}" for g in groups
    ]
    return "kv-groups=" + ";".join(parts)


def payload_digest(payload: memoryview | bytes) -> bytes:
    """Full-content hash of a chunk payload (xxh3-128, 16 bytes)."""
    return xxhash.xxh3_128_digest(payload)


@dataclass(frozen=True)
class ChunkCodec:
    """Encodes and verifies chunks of one model and layout (one per engine, shared by tiers)."""

    model: str  # 16 hex chars (fingerprint_model_dir / model_fingerprint)
    layout: str  # ChunkLayout.describe()
    payload_bytes: int  # ChunkLayout.chunk_bytes

    def __post_init__(self) -> None:
        if len(self.model.encode()) != 16:
            raise ValueError(f"model fingerprint must be 16 ASCII chars, got {self.model!r}")
        if len(self.layout.encode()) > _MAX_LAYOUT:
            raise ValueError(f"layout description longer than {_MAX_LAYOUT} bytes")

    @property
    def stored_bytes(self) -> int:
        """Header + payload: the size of one stored chunk."""
        return HEADER_BYTES + self.payload_bytes

    @property
    def namespace(self) -> str:
        """Directory / key-prefix component that separates models and layouts in shared tiers
        (a lookup never even finds another model's chunks; the header still checks)."""
        digest = hashlib.sha256(f"{self.layout}|v{STORAGE_FORMAT_VERSION}".encode()).hexdigest()
        return f"{self.model}-{digest[:12]}"

    def header(self, key: bytes, payload: memoryview | bytes) -> bytes:
        """The :data:`HEADER_BYTES` header of ``payload`` stored under ``key``."""
        if len(key) != 32:
            raise ValueError("chunk keys are 32-byte block hashes")
        if len(payload) != self.payload_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, expected {self.payload_bytes}")
        layout = self.layout.encode()
        fixed = _FIXED.pack(
            MAGIC, STORAGE_FORMAT_VERSION, len(layout), len(payload), payload_digest(payload),
            key, self.model.encode(),
        )  # fmt: skip
        return (fixed + layout).ljust(HEADER_BYTES, b"\0")

    def encode(self, key: bytes, payload: memoryview | bytes) -> bytes:
        """Header and payload as one value (one Redis value, one file)."""
        return self.header(key, payload) + bytes(payload)

    @functools.cached_property
    def _expected(self) -> tuple[bytes, bytes]:
        """The header's bytes that do not depend on the chunk: before the digest (magic,
        version, layout length, payload length) and after the key (model, layout)."""
        layout = self.layout.encode()
        fixed = _FIXED.pack(
            MAGIC, STORAGE_FORMAT_VERSION, len(layout), self.payload_bytes, bytes(16),
            bytes(32), self.model.encode(),
        )  # fmt: skip
        return fixed[:_DIGEST_AT], fixed[_KEY_AT + 32 :] + layout

    def check_header(self, key: bytes, header: memoryview | bytes) -> bytes | None:
        """The payload digest the header promises, or None if the header is not the one this
        codec would write for ``key`` (another model, layout, version or key; torn or empty).
        Every field is compared as the bytes this codec writes (one comparison per run of
        fixed bytes: reads check a header per chunk)."""
        if len(header) < HEADER_BYTES:
            return None
        head, tail = self._expected
        view = memoryview(header)
        if (
            view[:_DIGEST_AT] != head
            or view[_KEY_AT : _KEY_AT + 32] != key
            or view[_KEY_AT + 32 : _KEY_AT + 32 + len(tail)] != tail
        ):
            return None
        return bytes(view[_DIGEST_AT:_KEY_AT])

    def verify(self, key: bytes, stored: memoryview | bytes) -> memoryview | None:
        """The payload of a stored chunk (header + payload) if it is ``key``'s and intact."""
        view = memoryview(stored)
        if len(view) != self.stored_bytes:
            return None
        digest = self.check_header(key, view[:HEADER_BYTES])
        payload = view[HEADER_BYTES:]
        if digest is None or payload_digest(payload) != digest:
            return None
        return payload


def fingerprint_model_dir(model_dir: str | os.PathLike, *extra: str) -> str:
    """16 hex chars naming a model's weights (plus ``extra``: hash seed, dtype, ...).

    Hashes ``config.json``, the tokenizer files and, for every weight file, its name, size and
    64 pieces of 64 KiB spread over it (a fine-tune changes every tensor, so sampled content
    tells two checkpoints of one architecture apart; hashing every byte of a 16 GB checkpoint
    would add seconds to start-up). A directory without files hashes ``extra`` only.
    """
    h = hashlib.sha256()
    for part in extra:
        h.update(part.encode() + b"\0")
    root = Path(model_dir)
    if root.is_dir():
        names = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
        for name in names:
            p = root / name
            if p.is_file():
                h.update(name.encode() + b"\0" + p.read_bytes())
        weights = sorted(
            p for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".pt") and p.is_file()
        )
        for p in weights:
            size = p.stat().st_size
            h.update(f"{p.name}\0{size}\0".encode())
            with open(p, "rb") as f:
                pieces = 64
                for i in range(pieces):
                    f.seek(size * i // pieces)
                    h.update(f.read(65536))
    return h.hexdigest()[:16]
