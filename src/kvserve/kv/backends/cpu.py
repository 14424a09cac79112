"""The host-memory tier: one tensor of chunk slots, allocated once at exactly the asked size.

Owns the slot storage tensor, per-slot headers (key + checksum; layout and model are fixed
for the whole tier) and pinning; ``spare_slots`` of the size are kept out of allocation for
the caller's own use. ``size_bytes // chunk_bytes`` slots are allocated (and their
pages faulted in) up front, with no rounding; on CUDA the memory is pinned in place
(``cudaHostRegister``) rather than through the caching host allocator, which rounds requests up
to a power of two. With ``shared=True`` the slots live in a memfd (shared memory) instead of
anonymous memory, so that a storage writer process maps them and reads chunks in place
(:mod:`kvserve.kv.offload.storage_writer`): :attr:`shm_fd` is the descriptor to hand it,
:meth:`offset_of` the place of a slot's bytes in it.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import torch

from kvserve.kv.backends import register_backend
from kvserve.kv.backends.base import Backend, ChunkHeader, ChunkLayout
from kvserve.kv.backends.checksum import chunk_checksum, slot_checksums
from kvserve.kv.events import MEDIUM_CPU


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _fmt_gib(n: int) -> str:
    return f"{n / (1 << 30):.3f} GiB"


@register_backend("cpu")
class CpuBackend(Backend):
    """Chunk slots in host RAM; the transfer worker copies to/from :attr:`blocks` directly."""

    name = "cpu"
    medium = MEDIUM_CPU

    def __init__(
        self,
        layout: ChunkLayout,
        size_bytes: int,
        *,
        pin_memory: bool | None = None,
        model: str = "",
        spare_slots: int = 0,
        shared: bool = False,
    ) -> None:
        chunk_bytes = layout.chunk_bytes
        total_slots = int(size_bytes) // chunk_bytes
        num_slots = total_slots - spare_slots
        if num_slots < 1:
            raise ValueError(
                f"KV offload size {int(size_bytes)} bytes ({_fmt_gib(int(size_bytes))}) is smaller "
                f"than one offload chunk ({chunk_bytes} bytes = {layout.blocks_per_chunk} blocks "
                f"of {layout.block_bytes} bytes); raise kv_offload_size"
            )
        nbytes = total_slots * chunk_bytes
        avail = _mem_available()
        if avail is not None and nbytes > avail:
            raise MemoryError(
                f"cannot allocate the KV offload tier: {_fmt_gib(nbytes)} asked, only "
                f"{_fmt_gib(avail)} of host memory available; lower kv_offload_size"
            )
        k = layout.blocks_per_chunk
        self.shm_fd: int | None = None
        try:
            # Page-aligned, so with page-multiple chunks every slot starts on a page and storage
            # tiers read into slots directly with O_DIRECT (no bounce buffer).
            if shared:
                self.shm_fd = os.memfd_create("kvserve-host-tier", os.MFD_CLOEXEC)
                os.ftruncate(self.shm_fd, nbytes)
                self._mem = mmap.mmap(self.shm_fd, nbytes, flags=mmap.MAP_SHARED)
            else:
                self._mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as e:
            if self.shm_fd is not None:
                os.close(self.shm_fd)
            raise MemoryError(
                f"cannot allocate the KV offload tier ({_fmt_gib(nbytes)}): {e}"
            ) from e
        blocks = (
            torch.frombuffer(self._mem, dtype=torch.uint8)
            .view(layout.torch_dtype)
            .view(total_slots * k, *layout.block_shape)
        )
        # Fault every page in now (~0.5 s/GiB): the memory is really held from the start, and
        # page faults do not land on the transfer thread, where they cost 3x the copy and take a
        # core from the forward pass.
        blocks.zero_()
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.pinned = False
        if pin_memory:
            _pin_in_place(blocks)
            self.pinned = True
        super().__init__(layout, num_slots)
        self.model = model
        # Slots num_slots .. num_slots + num_spare - 1 are never allocated: the connector's
        # own (a chunk the tier has no room for, staged there on its way to a storage tier).
        self.num_spare = spare_slots
        # [(num_slots + num_spare) * blocks_per_chunk, *block_shape]: slot s holds blocks
        # s*k .. s*k+k-1.
        self.blocks = blocks
        self.slots_u8 = blocks.view(total_slots, -1).view(torch.uint8)
        self._keys: list[bytes | None] = [None] * total_slots
        self._checksums = [0] * total_slots
        self._k = k  # blocks per chunk: each one is sampled by the checksum
        self._base = int(np.frombuffer(self._mem, dtype=np.uint8).ctypes.data)

    def offset_of(self, view: memoryview) -> int:
        """Where ``view`` (bytes of this tier's memory, e.g. a slot of :attr:`slots_u8`)
        starts in it; ValueError for memory that is not this tier's."""
        try:  # a writable view (the slots): ~0.2 us, numpy's ctypes address ~1.6 us
            addr = ctypes.addressof(ctypes.c_char.from_buffer(view))
        except (TypeError, ValueError):  # read-only or empty
            addr = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
        off = addr - self._base
        if not 0 <= off <= len(self._mem) - view.nbytes:
            raise ValueError("buffer outside the host tier's memory")
        return off

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    # -- headers --------------------------------------------------------------------------
    def set_header(self, slot: int, key: bytes, checksum: int) -> None:
        self._checksums[slot] = checksum
        self._keys[slot] = key

    def header(self, slot: int) -> ChunkHeader | None:
        key = self._keys[slot]
        if key is None:
            return None
        return ChunkHeader(
            key=key,
            checksum=self._checksums[slot],
            layout=self.layout.describe(),
            model=self.model,
        )

    def record(
        self, slots: list[int], keys: list[bytes], checksums: list[int] | None = None
    ) -> None:
        """Headers for slots just written through :attr:`blocks`: ``checksums`` of what was
        meant to be written (:func:`block_checksums` of the source), else hashed here."""
        sums = slot_checksums(self.slots_u8, slots, self._k) if checksums is None else checksums
        for s, k, c in zip(slots, keys, sums, strict=True):
            self.set_header(s, k, c)

    def verify(self, slots: list[int], keys: list[bytes]) -> list[bool]:
        """Per slot: does it hold ``key`` with bytes matching its recorded checksum?"""
        sums = slot_checksums(self.slots_u8, slots, self._k)
        return [
            self._keys[s] == k and self._checksums[s] == c
            for s, k, c in zip(slots, keys, sums, strict=True)
        ]

    def free_slots(self, slots) -> None:
        slots = list(slots)
        for s in slots:
            self._keys[s] = None
        super().free_slots(slots)

    # -- one chunk ------------------------------------------------------------------------
    def chunk_view(self, slot: int) -> torch.Tensor:
        k = self.layout.blocks_per_chunk
        return self.blocks[slot * k : (slot + 1) * k]

    def write_chunk(self, slot: int, data: torch.Tensor, header: ChunkHeader) -> None:
        view = self.chunk_view(slot)
        view.copy_(data.reshape(view.shape))
        self.set_header(slot, header.key, chunk_checksum(view, self._k))

    def read_chunk(self, slot: int, out: torch.Tensor) -> ChunkHeader | None:
        header = self.header(slot)
        if header is None:
            return None
        view = self.chunk_view(slot)
        if chunk_checksum(view, self._k) != header.checksum:
            return None
        out.copy_(view.reshape(out.shape))
        return header

    def close(self) -> None:
        if self.pinned:
            _unpin(self.blocks)
            self.pinned = False
        if self.shm_fd is not None:  # the mapping stays valid while tensors view it
            os.close(self.shm_fd)
            self.shm_fd = None


def _pin_in_place(t: torch.Tensor) -> None:  # pragma: no cover - needs CUDA
    """Page-lock ``t``'s memory exactly (no power-of-two rounding of the caching allocator)."""
    nbytes = t.numel() * t.element_size()
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    code = int(getattr(err, "value", err))
    if code != 0:
        raise MemoryError(
            f"cannot pin {_fmt_gib(nbytes)} of host memory for the KV offload tier "
            f"(cudaHostRegister error {code}); lower kv_offload_size or raise the memlock limit"
        )


def _unpin(t: torch.Tensor) -> None:  # pragma: no cover - needs CUDA
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
