"""A model of PyTorch's CUDA caching allocator, replayed over a recorded sequence of allocations and frees.

What `torch.cuda.max_memory_allocated()` reports is not the sum of tensor sizes: every request is rounded up and
served by a *block* carved out of a cached *segment*, and the allocated statistic counts whole blocks. This module
replays the allocations of a simulated step through the same rules as ``c10/cuda/CUDACachingAllocator.cpp`` with its
default settings (no ``PYTORCH_CUDA_ALLOC_CONF``):

- a request of ``n`` bytes is rounded to a multiple of 512 bytes (at least 512); zero-byte requests take no block;
- requests of at most 1 MiB come from the *small* pool, whose segments are 2 MiB; larger ones from the *large*
  pool, whose new segments are 20 MiB for requests under 10 MiB and the request rounded up to 2 MiB otherwise;
- a request takes the smallest cached free block of its pool that fits (best fit, lowest address on ties); if none
  fits, a new segment is reserved (``cudaMalloc``);
- the block is split when the remainder is at least 512 bytes (small pool) or more than 1 MiB (large pool); an
  unsplit remainder stays part of the allocated block, so it counts as allocated;
- a freed block returns to its pool and merges with free neighbours of the same segment.

Not modelled: several streams (all blocks are taken as one stream's), ``expandable_segments``, ``max_split_size_mb``
and ``roundup_power2_divisions``, releasing cached segments on out-of-memory, and allocations the caching allocator
makes for libraries (cuBLAS / cuDNN workspaces) or that kernels make internally without a tensor.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Final, Literal

MIN_BLOCK_SIZE: Final[int] = 512
"""Every block is a multiple of this many bytes (``kMinBlockSize``)."""
SMALL_SIZE: Final[int] = 1 << 20
"""Largest request served by the small pool (``kSmallSize``, 1 MiB)."""
SMALL_BUFFER: Final[int] = 2 << 20
"""Segment size of the small pool (``kSmallBuffer``, 2 MiB)."""
LARGE_BUFFER: Final[int] = 20 << 20
"""Segment size for large requests under ``MIN_LARGE_ALLOC`` (``kLargeBuffer``, 20 MiB)."""
MIN_LARGE_ALLOC: Final[int] = 10 << 20
"""Requests from this size on get a segment of their own size rounded to ``ROUND_LARGE`` (``kMinLargeAlloc``)."""
ROUND_LARGE: Final[int] = 2 << 20
"""Rounding of large segments (``kRoundLarge``, 2 MiB)."""

AllocatorKind = Literal["cuda", "exact"]
ALLOCATOR_KINDS: Final[tuple[str, ...]] = ("cuda", "exact")


def round_request(nbytes: int) -> int:
    """The size the caching allocator looks for when asked for ``nbytes`` (0 stays 0: no block is taken)."""
    if nbytes <= 0:
        return 0
    return max(MIN_BLOCK_SIZE, -(-nbytes // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE)


def segment_size(rounded: int) -> int:
    """Bytes the allocator reserves with ``cudaMalloc`` when no cached block fits a request of ``rounded`` bytes."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-rounded // ROUND_LARGE) * ROUND_LARGE


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


@dataclass
class _Pool:
    """Free blocks of one pool, sorted by (size, segment, offset) for best-fit search."""

    keys: list[tuple[int, int, int]] = field(default_factory=list)
    blocks: dict[tuple[int, int, int], _Block] = field(default_factory=dict)

    def add(self, block: _Block) -> None:
        key = block.key()
        bisect.insort(self.keys, key)
        self.blocks[key] = block

    def remove(self, block: _Block) -> None:
        key = block.key()
        del self.keys[bisect.bisect_left(self.keys, key)]
        del self.blocks[key]

    def best_fit(self, size: int) -> _Block | None:
        index = bisect.bisect_left(self.keys, (size, -1, -1))
        return self.blocks[self.keys[index]] if index < len(self.keys) else None


class CachingAllocatorModel:
    """Replays allocations and frees; ``allocated`` and ``reserved`` follow the CUDA caching allocator's statistics.

    ``kind="cuda"`` applies the caching allocator's rules (see the module docstring); ``kind="exact"`` counts every
    request at its exact size (what the live-tensor tracker measures), which makes replays comparable.
    """

    def __init__(self, kind: AllocatorKind = "cuda") -> None:
        if kind not in ALLOCATOR_KINDS:
            raise ValueError(f"kind: got {kind!r}; allowed: {', '.join(ALLOCATOR_KINDS)}")
        self.kind: AllocatorKind = kind
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.segments = 0
        self._small = _Pool()
        self._large = _Pool()
        self._live: dict[int, tuple[int, _Block | None]] = {}

    def malloc(self, handle: int, nbytes: int) -> int:
        """Serve a request of ``nbytes`` identified by ``handle``; returns the bytes counted as allocated for it."""
        if handle in self._live:
            raise ValueError(f"allocation {handle} is already live")
        if self.kind == "exact" or nbytes <= 0:
            size, block = max(int(nbytes), 0), None
        else:
            block = self._take_block(round_request(nbytes))
            size = block.size
        self._live[handle] = (size, block)
        self.allocated += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return size

    def free(self, handle: int) -> int:
        """Release the allocation ``handle``; returns the bytes it held."""
        size, block = self._live.pop(handle)
        self.allocated -= size
        if block is not None:
            self._release_block(block)
        return size

    def resize(self, handle: int, nbytes: int) -> int:
        """A storage resized in place (FSDP2 frees and re-gathers parameters this way): the new block is taken while
        the old one is still held (its contents are copied), then the old one is freed. Returns the new bytes."""
        old_size, old_block = self._live.pop(handle)
        new_size = self.malloc(handle, nbytes)
        self.allocated -= old_size
        if old_block is not None:
            self._release_block(old_block)
        return new_size

    def live_bytes(self, handle: int) -> int:
        """Bytes counted for the live allocation ``handle``."""
        return self._live[handle][0]

    # ------------------------------------------------------------------ blocks
    def _take_block(self, size: int) -> _Block:
        small = size <= SMALL_SIZE
        pool = self._small if small else self._large
        block = pool.best_fit(size)
        if block is None:
            reserved = segment_size(size)
            self.reserved += reserved
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            block = _Block(segment=self.segments, offset=0, size=reserved, small=small)
            self.segments += 1
        else:
            pool.remove(block)
        remaining = block.size - size
        if remaining >= MIN_BLOCK_SIZE if small else remaining > SMALL_SIZE:
            rest = _Block(segment=block.segment, offset=block.offset + size, size=remaining, small=small,
                          prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.add(rest)
        block.free = False
        return block

    def _release_block(self, block: _Block) -> None:
        pool = self._small if block.small else self._large
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                pool.remove(neighbour)
                if neighbour is block.prev:
                    block.offset = neighbour.offset
                    block.prev = neighbour.prev
                    if neighbour.prev is not None:
                        neighbour.prev.next = block
                else:
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
                block.size += neighbour.size
        pool.add(block)

