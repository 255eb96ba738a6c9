"""Content hashes of checkpoint files, streamed (never a whole file in memory) and spread over a few threads.

SHA-256 through ``hashlib`` with a 1 MiB read buffer. Measured on this project's 2-core build CPU (x86_64 with
SHA-NI), page-cached files, when the cores were free: sha256 1627 MiB/s (1 MiB buffers; 1648 at 4 MiB), blake2b
812-1102 MiB/s, sha1 1757 MiB/s; with a load average of ~9.5 from other processes,
`benchmarks/bench_checkpoint_hash.py` measured sha256 394-491 MiB/s and blake2b 359-385 MiB/s
(benchmarks/results/checkpoint_hash.md). So sha256, a standard digest anyone can check with ``sha256sum``, costs no
more than the alternatives. ``hashlib`` releases the GIL while it hashes, so files are hashed in parallel threads
(one per file, up to `MAX_THREADS`). The files are hashed right after they are written, while they are still in the
page cache: the writers are torch.save, safetensors and torch.distributed.checkpoint, so hashing inside them would
save only that cached re-read, not the hashing itself.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HASH_ALGORITHM = "sha256"
READ_BUFFER_BYTES = 1 << 20
MAX_THREADS = 8


def file_digest(path: Path) -> str:
    """Hex SHA-256 of the file at `path`, read in `READ_BUFFER_BYTES` pieces."""
    digest = hashlib.new(HASH_ALGORITHM)
    buffer = bytearray(READ_BUFFER_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while read := handle.readinto(view):
            digest.update(view[:read])
    return digest.hexdigest()


def digests(paths: list[Path]) -> list[str]:
    """`file_digest` of each path, in order, hashed by up to `MAX_THREADS` threads."""
    workers = max(1, min(len(paths), MAX_THREADS, os.cpu_count() or 1))
    if workers == 1:
        return [file_digest(p) for p in paths]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="remat-hash") as pool:
        return list(pool.map(file_digest, paths))
