"""What a storage tier below host memory is: chunks addressed by key, verified on every read.

Owns the :class:`StorageBackend` interface (disk, shared file system, Redis/Valkey implement
it, one file each, registered by name in :mod:`kvserve.kv.backends`), its counters, and the
parsing of tier specifications (``disk:path=/var/kv,size=64`` on the CLI, a dict in YAML or the
offline API).

Contract (every implementation, tested by ``tests/kv/test_storage_contract.py``):

- keys are 32-byte chunk keys; values are :class:`ChunkCodec` payloads (``payload_bytes``);
  what is stored is ``codec.header(key, payload) + payload``, written atomically (a reader
  never sees a torn chunk: a rename, one SET, or a slot published only after its write);
- :meth:`get` verifies the header and the full-content hash; a chunk that fails is a miss,
  counted in ``corrupt`` and removed from the tier; it never raises for a missing or bad
  chunk;
- I/O errors (server down, disk full, permission denied) are caught, counted in ``errors``
  and reported as misses / failed writes: a failing tier degrades to recompute;
- methods block on I/O and are thread-safe: the storage worker calls them from its threads,
  never from the engine's step;
- a private tier (``shared = False``) reports the keys it evicted through :meth:`take_evicted`
  (they become KV events); a shared tier cannot know what other instances evicted.

Writes made by a writer process (:mod:`kvserve.kv.offload.storage_writer`) are split in three:
:meth:`begin_put` here (what to write where: a private tier picks its slots under its own index,
no I/O), :meth:`put_planned` in the writer process, on the tier :meth:`open_writer` made there
from :meth:`writer_spec`, and :meth:`end_put` here (the writes published, the writer's counters
added). A key-addressed tier's writer is simply another client of the same store.
"""

from __future__ import annotations

import contextlib
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from kvserve.kv.backends.chunk_format import ChunkCodec

GiB = 1 << 30
# begin_put's target of a key-addressed write (no slot).
KEYED = -1


def lower_thread_priority(policy: str = "idle") -> None:
    """Background tier work (writes, retention sweeps) must not take cores from a CPU engine's
    forward pass. ``idle``: the calling thread runs under ``SCHED_IDLE`` (Linux schedules
    threads individually): it runs on cores nothing else wants and never preempts the engine's
    threads when it wakes (a nice-19 thread still does, stalling torch's OpenMP team at its
    next barrier); where that is refused, or with ``nice``, the thread is niced to 19;
    ``normal`` leaves it as it is."""
    if policy not in ("idle", "nice", "normal"):
        raise ValueError(f"thread priority policy must be idle, nice or normal, got {policy!r}")
    if policy == "normal":
        return
    if policy == "idle":
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_IDLE, os.sched_param(0))
            return
    # Not Linux, or not permitted: the thread runs at normal priority.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


@dataclass
class TierStats:
    """Monotonic counters of one tier (exported as ``kvserve:kv_tier_*{tier=...}``)."""

    lookups: int = 0  # keys asked in exists()
    hits: int = 0  # chunks read and verified
    misses: int = 0  # chunks asked in get() and not served (absent, corrupt or error)
    corrupt: int = 0  # chunks whose header or hash did not match (removed)
    errors: int = 0  # I/O errors (each failed call or chunk)
    read_bytes: int = 0
    read_s: float = 0.0
    written: int = 0  # chunks written
    write_bytes: int = 0
    write_s: float = 0.0
    write_skipped: int = 0  # already present (shared tiers: another instance wrote it)
    dropped: int = 0  # stores not attempted (queue full, over the watermark, too old)
    evicted: int = 0

    def as_dict(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


class StorageBackend(ABC):
    """A tier below host memory. Subclasses set the class attributes and implement the I/O."""

    name: ClassVar[str]  # registry name: "disk", "fs", "redis"
    # KV event medium: vLLM's storage convention, with our tier named in the event's `tier`.
    medium: ClassVar[str] = "STORAGE"
    locality: ClassVar[str] = "LOCAL"  # LOCAL (this node) | REMOTE (over the network)
    shared: ClassVar[bool] = False  # written and read by several instances
    # exists() answers from memory (no I/O): the connector may look up on the engine thread
    # instead of making the request wait a step for an asynchronous lookup.
    lookup_in_memory: ClassVar[bool] = False
    # Reads may come from the page cache (a memory copy: bound by memory bandwidth, which one
    # thread nearly saturates) or wait on a device (where more reads in flight help): get()
    # takes ``on_wait``, called when a read finds its chunk not cached, so that the caller
    # reads with one thread until then and spreads the rest over its I/O threads after.
    page_cache_reads: ClassVar[bool] = False

    def __init__(self, codec: ChunkCodec, *, tier_id: str | None = None) -> None:
        self.codec = codec
        # Names this tier in events and metrics; instances that share a tier agree on it
        # (the path or URL, without credentials), which is how the router learns who shares.
        self.tier_id = tier_id or self.name
        self.stats = TierStats()
        self._stats_lock = threading.Lock()
        self._evicted: list[bytes] = []

    # -- the I/O (blocking, thread-safe) ----------------------------------------------------
    @abstractmethod
    def exists(self, keys: Sequence[bytes]) -> int:
        """Length of the leading run of ``keys`` the tier holds (one batched round trip where
        the medium allows). Presence only: :meth:`get` still verifies."""

    @abstractmethod
    def get(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[bool]:
        """Read and verify each chunk's payload into ``outs[i]`` (``payload_bytes`` each).
        False: a miss (absent, corrupt — then removed —, or an I/O error); ``outs[i]`` may
        then hold garbage and must not be used. A tier with :attr:`page_cache_reads` also
        takes ``on_wait`` (a callable, or None), called once per call, before the first read
        that has to wait."""

    @abstractmethod
    def put(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[memoryview],
        headers: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Store each payload under its key (skipping keys already held). True when the chunk
        is in the tier afterwards. ``headers``: ``codec.header(key, payload)`` of each chunk,
        when the caller made them already (the storage worker hashes a chunk once for all its
        tiers); else the tier makes them."""

    @abstractmethod
    def remove(self, keys: Sequence[bytes]) -> None:
        """Forget these chunks (found bad elsewhere, or asked by tests)."""

    def usage(self) -> tuple[int, int]:
        """(bytes used, capacity in bytes; 0 when unbounded or unknown)."""
        return 0, 0

    def event_fields(self) -> dict[str, Any]:
        """What KV events say about this tier (``medium`` is :attr:`medium`)."""
        return {"locality": self.locality, "tier": self.tier_id, "shared": self.shared}

    def take_evicted(self) -> list[bytes]:
        """Keys this tier evicted since the last call (private tiers)."""
        with self._stats_lock:
            out, self._evicted = self._evicted, []
        return out

    def close(self) -> None:  # noqa: B027
        """Release files, connections and threads."""

    # -- writes made in a writer process ------------------------------------------------------
    def writer_spec(self, options: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """What a writer process needs to open this tier's write side (:meth:`open_writer`):
        plain-data options (JSON) and file descriptors it inherits. ``options``: this tier's
        own, from its spec. Default: the same options (another client of the same store)."""
        return dict(options), []

    @classmethod
    def open_writer(cls, codec: ChunkCodec, options: dict[str, Any], fds: list[int]) -> Any:
        """The write side of a tier in a writer process: an object with :meth:`put_planned`,
        :meth:`take_stats` and :meth:`close` (default: the backend itself, opened there)."""
        return cls(codec, **options)

    def begin_put(self, keys: Sequence[bytes]) -> list[int | None]:
        """Engine side of a write made elsewhere: per key, where the writer puts it (``-1``:
        by key; a private tier's slot) or None (not written: held already, or dropped)."""
        return [KEYED] * len(keys)

    def put_planned(
        self,
        keys: Sequence[bytes],
        payloads: Sequence[memoryview],
        headers: Sequence[bytes] | None,
        targets: Sequence[int | None],
    ) -> list[bool]:
        """Writer side: store the chunks whose target is not None (:meth:`put` by default)."""
        idx = [i for i, t in enumerate(targets) if t is not None]
        ok = [False] * len(keys)
        if idx:
            res = self.put(
                [keys[i] for i in idx],
                [payloads[i] for i in idx],
                None if headers is None else [headers[i] for i in idx],
            )
            for i, r in zip(idx, res, strict=True):
                ok[i] = r
        return ok

    def end_put(
        self,
        keys: Sequence[bytes],
        targets: Sequence[int | None],
        ok: Sequence[bool],
        stats: dict[str, float],
    ) -> list[bool]:
        """Engine side, once the writer answered (``ok`` all False when it died): publish what
        was written, add the writer's counters; True per key in the tier afterwards."""
        self.add_stats(stats)
        return list(ok)

    def take_stats(self) -> dict[str, float]:
        """The counters since the last call, reset (a writer process reports them)."""
        with self._stats_lock:
            s, self.stats = self.stats, TierStats()
        return {k: v for k, v in s.as_dict().items() if v}

    def add_stats(self, stats: dict[str, float]) -> None:
        """Add counters another process took (:meth:`take_stats`)."""
        with self._stats_lock:
            for k, v in stats.items():
                if hasattr(self.stats, k):
                    cur = getattr(self.stats, k)
                    setattr(self.stats, k, cur + (int(v) if isinstance(cur, int) else v))

    # -- helpers for implementations ---------------------------------------------------------
    def count(self, **deltas: float) -> None:
        with self._stats_lock:
            s = self.stats
            for k, v in deltas.items():
                setattr(s, k, getattr(s, k) + v)

    def note_evicted(self, keys: Sequence[bytes]) -> None:
        with self._stats_lock:
            self._evicted.extend(keys)
            self.stats.evicted += len(keys)


@dataclass
class TierSpec:
    """One configured tier: its backend name and the backend's own options."""

    type: str
    options: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """For logs: the options, secrets masked."""

        def public(k: str, v: Any) -> str:
            if k == "password":
                return "***"
            if k == "url" and "@" in str(v):  # drop the credentials of scheme://user:pw@host
                scheme, _, rest = str(v).partition("://")
                return f"{scheme}://***@{rest.rpartition('@')[2]}"
            return str(v)

        opts = ",".join(f"{k}={public(k, v)}" for k, v in self.options.items())
        return f"{self.type}:{opts}" if opts else self.type


def parse_size(value: Any) -> int:
    """Bytes from ``64`` (GiB, the unit of every size flag), ``"512MiB"``, ``"1.5GiB"``,
    ``"2TB"``, ``"4096B"``."""
    if isinstance(value, int | float):
        return int(float(value) * GiB)
    s = str(value).strip()
    units = {
        "tib": 1 << 40, "tb": 10**12, "gib": GiB, "gb": 10**9, "mib": 1 << 20, "mb": 10**6,
        "kib": 1 << 10, "kb": 10**3, "b": 1,
    }  # fmt: skip
    low = s.lower()
    for unit, mult in units.items():
        if low.endswith(unit):
            return int(float(low[: -len(unit)].strip()) * mult)
    return int(float(s) * GiB)


def parse_flag(value: Any, name: str) -> bool:
    """A boolean tier option from a bool or a CLI string (``true``/``false``, ``1``/``0``,
    ``yes``/``no``, ``on``/``off``)."""
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be true or false, got {value!r}")


def parse_tier_spec(spec: str | dict[str, Any] | TierSpec) -> TierSpec:
    """``"disk:path=/var/kv,size=64"`` or ``{"type": "disk", "path": ..., "size": ...}``."""
    if isinstance(spec, TierSpec):
        return spec
    if isinstance(spec, dict):
        opts = dict(spec)
        kind = opts.pop("type", None)
        if not kind:
            raise ValueError(f"tier {spec!r} has no 'type'")
        return TierSpec(str(kind), opts)
    kind, _, rest = str(spec).partition(":")
    opts: dict[str, Any] = {}
    if rest:
        # A URL may hold commas only in its query string: split on commas before a key=.
        parts: list[str] = []
        for piece in rest.split(","):
            if parts and "=" not in piece:
                parts[-1] += "," + piece
            else:
                parts.append(piece)
        for part in parts:
            k, eq, v = part.partition("=")
            if not eq:
                raise ValueError(f"tier option {part!r} in {spec!r} is not key=value")
            opts[k.strip().replace("-", "_")] = v.strip()
    if not kind.strip():
        raise ValueError(f"tier spec {spec!r} has no type (e.g. disk:path=/var/kv,size=64)")
    return TierSpec(kind.strip(), opts)


def load_tier_write_options(config_file: str) -> dict[str, Any]:
    """The YAML file's ``write:`` mapping (``{tiers: [...], write: {duty: 0.5, ...}}``; a file
    that is a plain list of tiers has none)."""
    import yaml

    with open(config_file) as f:
        doc = yaml.safe_load(f)
    opts = doc.get("write", {}) if isinstance(doc, dict) else {}
    if not isinstance(opts, dict):
        raise ValueError(f"{config_file}: 'write' must be a mapping of write options")
    return opts


def load_tier_specs(cli_specs: Sequence[str], config_file: str | None) -> list[TierSpec]:
    """Tiers in lookup order: the YAML file's (a list, or ``{tiers: [...]}``), then the CLI's."""
    specs: list[TierSpec] = []
    if config_file:
        import yaml

        with open(config_file) as f:
            doc = yaml.safe_load(f)
        items = doc.get("tiers", []) if isinstance(doc, dict) else doc
        if not isinstance(items, list):
            raise ValueError(f"{config_file}: expected a list of tiers")
        specs.extend(parse_tier_spec(item) for item in items)
    specs.extend(parse_tier_spec(s) for s in cli_specs)
    return specs
