"""The offloading manager: which chunks a tier holds, their state, eviction and KV events.

Owns the key -> slot map of one tier and each chunk's ref count:
``-1`` = store in flight (not readable), ``0`` = stored and evictable, ``> 0`` = being read by
that many loads. Only chunks at 0 are ever evicted, so a chunk being loaded or stored is never
overwritten. Slots come from the backend, eviction order from the policy; the manager never
touches data (the transfer worker does) and never sees requests (the connector does).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.kv.backends.base import Backend
from kvserve.kv.events import AnyKVEvent, BlockRemoved, BlockStored
from kvserve.kv.offload.policies import EvictionPolicy, create_policy

ChunkKey = bytes  # block hash of the chunk's last block


class LookupState(enum.Enum):
    MISS = 0
    HIT = 1  # stored, readable
    HIT_PENDING = 2  # store in flight: present soon, not readable now


@dataclass
class ChunkMeta:
    """What a KV event must say about one chunk (the connector knows it from the request)."""

    block_hashes: list[int]  # hash_to_int of each engine block of the chunk, in order
    parent_block_hash: int | None
    token_ids: list[int]
    extra_keys: list | None = None  # per block: None or that block's extra hash keys
    lora_name: str | None = None
    # The KV cache group of the chunk (hybrid models: one chunk per group), as in events.
    group_idx: int = 0
    kv_cache_spec_kind: str = "full_attention"
    kv_cache_spec_sliding_window: int | None = None

    def stored_event(self, block_size: int, medium: str, **fields: Any) -> BlockStored:
        """This chunk's ``BlockStored`` (``fields``: a storage tier's, such as ``locality``).
        Its lists are copies that a run of chunks may extend; ``extra_keys`` has an entry per
        block (None where a block has none) until :func:`finish_extra_keys`."""
        return BlockStored(
            block_hashes=list(self.block_hashes),
            parent_block_hash=self.parent_block_hash,
            token_ids=list(self.token_ids),
            block_size=block_size,
            medium=medium,
            lora_name=self.lora_name,
            extra_keys=list(self.extra_keys or [None] * len(self.block_hashes)),
            group_idx=self.group_idx,
            kv_cache_spec_kind=self.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=self.kv_cache_spec_sliding_window,
            **fields,
        )


@dataclass
class LoadSpec:
    """Where the chunks to load are: one slot per key, in order."""

    slots: list[int]


@dataclass
class PrepareStoreOutput:
    keys_to_store: list[ChunkKey]  # in the order given; keys already held are left out
    slots: list[int]  # destination slot of each key to store
    evicted_keys: list[ChunkKey]


@dataclass
class ManagerStats:
    stored: int = 0  # chunks that became loadable
    store_failed: int = 0
    evicted: int = 0
    removed_invalid: int = 0
    rejected: int = 0  # keys not stored for lack of evictable room
    allocation_failures: int = 0  # prepare_store calls that could not store every key


@dataclass(slots=True)
class _Entry:
    slot: int
    ref: int  # -1 storing, 0 evictable, >0 readers
    meta: ChunkMeta | None
    invalid: bool = False  # found corrupt: dropped once the last reader is done


class OffloadingManager:
    """Key-level bookkeeping of one tier (backend + eviction policy)."""

    def __init__(
        self,
        backend: Backend,
        policy: EvictionPolicy | str = "lru",
        *,
        block_size: int = 16,  # engine block size, for KV events
        emit_events: bool = True,
    ) -> None:
        self.backend = backend
        self.policy = (
            create_policy(policy, backend.num_slots) if isinstance(policy, str) else policy
        )
        self.block_size = block_size
        self.emit_events = emit_events
        self.medium = backend.medium
        self.stats = ManagerStats()
        self._entries: dict[ChunkKey, _Entry] = {}
        self._events: list[AnyKVEvent] = []
        self._num_evictable = 0  # entries at ref 0

    # -- queries --------------------------------------------------------------------------
    def state(self, key: ChunkKey) -> LookupState:
        e = self._entries.get(key)
        if e is None or e.invalid:
            return LookupState.MISS
        return LookupState.HIT_PENDING if e.ref < 0 else LookupState.HIT

    def lookup(self, keys: Iterable[ChunkKey]) -> int:
        """Number of leading keys that are stored and readable now."""
        n = 0
        entries = self._entries
        for key in keys:
            e = entries.get(key)
            if e is None or e.ref < 0 or e.invalid:
                break
            n += 1
        return n

    def slot_of(self, key: ChunkKey) -> int | None:
        e = self._entries.get(key)
        return None if e is None else e.slot

    def meta_of(self, key: ChunkKey) -> ChunkMeta | None:
        e = self._entries.get(key)
        return None if e is None else e.meta

    def ref_count(self, key: ChunkKey) -> int | None:
        e = self._entries.get(key)
        return None if e is None else e.ref

    @property
    def num_chunks(self) -> int:
        return len(self._entries)

    def num_reservable(self) -> int:
        """Slots a :meth:`prepare_store` could have now: free ones and evictable chunks'
        (the others are pinned by loads or being stored, and free up when those end)."""
        return self.backend.num_free_slots() + self._num_evictable

    @property
    def capacity(self) -> int:
        return self.backend.num_slots

    @property
    def usage(self) -> float:
        return len(self._entries) / self.backend.num_slots

    # -- loads ----------------------------------------------------------------------------
    def prepare_load(self, keys: Sequence[ChunkKey]) -> LoadSpec:
        """Pin ``keys`` (all must be HIT) for reading; returns their slots."""
        for key in keys:
            if self.state(key) is not LookupState.HIT:
                raise KeyError(f"chunk {key.hex()[:16]} is not loadable")
        slots = []
        for key in keys:
            e = self._entries[key]
            if e.ref == 0:
                self._num_evictable -= 1
            e.ref += 1
            self.policy.touch(key)
            slots.append(e.slot)
        return LoadSpec(slots)

    def complete_load(self, keys: Iterable[ChunkKey]) -> None:
        """Unpin ``keys`` after a load finished (or was abandoned)."""
        for key in keys:
            e = self._entries.get(key)
            if e is None or e.ref <= 0:
                raise RuntimeError(f"complete_load of chunk {key.hex()[:16]} that is not loading")
            e.ref -= 1
            if e.ref == 0:
                self._num_evictable += 1
                if e.invalid:
                    self._drop(key, e, removed=True)

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        """Mark held keys as used now (also for chunks that hit in a higher tier)."""
        for key in keys:
            e = self._entries.get(key)
            if e is not None and e.ref >= 0:
                self.policy.touch(key)

    # -- stores ---------------------------------------------------------------------------
    def prepare_store(
        self,
        keys: Sequence[ChunkKey],
        metas: Sequence[ChunkMeta | None] | None = None,
    ) -> PrepareStoreOutput | None:
        """Reserve slots for the keys not held yet, evicting evictable chunks as needed.

        Keys are taken in order while room can be made (a prefix of a sequence is worth more
        than its tail); keys of this call that are already held are never evicted for it.
        Returns None when not even the first new key fits.
        """
        entries = self._entries
        todo: list[tuple[ChunkKey, ChunkMeta | None]] = []
        seen: set[ChunkKey] = set()
        for i, key in enumerate(keys):
            if key in entries or key in seen:
                continue
            seen.add(key)
            todo.append((key, metas[i] if metas is not None else None))
        if not todo:
            return PrepareStoreOutput([], [], [])

        need = len(todo) - self.backend.num_free_slots()
        evicted: list[ChunkKey] = []
        if need > 0:
            protected = set(keys)

            def evictable(k: ChunkKey) -> bool:
                return entries[k].ref == 0 and k not in protected

            evicted = self.policy.evict_many(need, evictable)
            self._drop_evicted(evicted)
            self.stats.evicted += len(evicted)
            if len(evicted) < need:
                fit = len(todo) - (need - len(evicted))
                self.stats.rejected += len(todo) - fit
                self.stats.allocation_failures += 1
                todo = todo[:fit]
                if not todo:
                    return None

        slots = self.backend.allocate_slots(len(todo))
        for (key, meta), slot in zip(todo, slots, strict=True):
            entries[key] = _Entry(slot, -1, meta)
        return PrepareStoreOutput([k for k, _ in todo], slots, evicted)

    def complete_store(self, keys: Iterable[ChunkKey], success: bool = True) -> None:
        """Stores of ``keys`` ended: make them loadable, or drop them on failure."""
        keys = list(keys)
        entries = self._entries
        stored: list[_Entry] = []
        for key in keys:
            e = entries.get(key)
            if e is None or e.ref != -1:
                raise RuntimeError(f"complete_store of chunk {key.hex()[:16]} that is not storing")
            if success:
                e.ref = 0
                stored.append(e)
            else:
                self.stats.store_failed += 1
                self._drop(key, e, removed=False, in_policy=False)
        if success:
            self._num_evictable += len(keys)
            self.stats.stored += len(keys)
            self.policy.insert_many(keys)
            if self.emit_events:
                self._emit_stored(stored)

    # -- invalid chunks -------------------------------------------------------------------
    def remove(self, keys: Iterable[ChunkKey]) -> None:
        """Drop chunks found invalid (a miss from now on; freed when no load reads them)."""
        for key in keys:
            e = self._entries.get(key)
            if e is None or e.invalid:
                continue
            self.stats.removed_invalid += 1
            if e.ref == 0:
                self._drop(key, e, removed=True)
            else:
                e.invalid = True

    def clear(self) -> None:
        """Drop every evictable chunk (pinned and in-flight ones stay)."""
        for key, e in list(self._entries.items()):
            if e.ref == 0:
                self._drop(key, e, removed=True)

    def check_integrity(self) -> None:
        evictable = sum(e.ref == 0 for e in self._entries.values())
        if evictable != self._num_evictable:
            raise AssertionError(f"{evictable} evictable chunks, counted {self._num_evictable}")

    # -- events ---------------------------------------------------------------------------
    def take_events(self) -> list[AnyKVEvent]:
        events, self._events = self._events, []
        return events

    def _drop(self, key: ChunkKey, e: _Entry, *, removed: bool, in_policy: bool = True) -> None:
        """Forget ``key`` and free its slot; ``removed``: it was loadable (emit BlockRemoved)."""
        del self._entries[key]
        if e.ref == 0:
            self._num_evictable -= 1
        if in_policy:
            self.policy.remove(key)
        self.backend.free_slots([e.slot])
        if removed and self.emit_events and e.meta is not None:
            self._events.append(
                BlockRemoved(
                    block_hashes=list(e.meta.block_hashes),
                    medium=self.medium,
                    group_idx=e.meta.group_idx,
                )
            )

    def _drop_evicted(self, keys: list[ChunkKey]) -> None:
        """:meth:`_drop` of evicted keys (evictable, already out of the policy), their slots
        freed in one call."""
        entries = self._entries
        slots: list[int] = []
        for key in keys:
            e = entries.pop(key)
            slots.append(e.slot)
            if self.emit_events and e.meta is not None:
                self._events.append(
                    BlockRemoved(
                        block_hashes=list(e.meta.block_hashes),
                        medium=self.medium,
                        group_idx=e.meta.group_idx,
                    )
                )
        self._num_evictable -= len(keys)
        self.backend.free_slots(slots)

    def _emit_stored(self, entries: list[_Entry]) -> None:
        """One BlockStored per run of chunks that continue each other's hash chain."""
        event: BlockStored | None = None
        for e in entries:
            m = e.meta
            if m is None:
                continue
            extra = m.extra_keys or [None] * len(m.block_hashes)
            if (
                event is not None
                and event.lora_name == m.lora_name
                and event.group_idx == m.group_idx
                and m.parent_block_hash == event.block_hashes[-1]
            ):
                event.block_hashes.extend(m.block_hashes)
                event.token_ids.extend(m.token_ids)
                event.extra_keys.extend(extra)
                continue
            if event is not None:
                self._events.append(finish_extra_keys(event))
            event = m.stored_event(self.block_size, self.medium)
        if event is not None:
            self._events.append(finish_extra_keys(event))


def finish_extra_keys(event: BlockStored) -> BlockStored:
    """No ``extra_keys`` at all where no block has any (as vLLM's events say it)."""
    if event.extra_keys is not None and all(x is None for x in event.extra_keys):
        event.extra_keys = None
    return event
