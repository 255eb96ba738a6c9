"""`dataset_fingerprint`: a short content hash of tokenized training rows, saved with training state so that a resume
can tell "the same data" from "other data with the same number of rows"."""

from __future__ import annotations

import hashlib

import torch

from remat.data.dataset import TokenizedDataset

FINGERPRINT_SCHEME = "blake2b-128/v1"
"""Names how `dataset_fingerprint` hashes; a different scheme is never compared with this one."""


def dataset_fingerprint(dataset: TokenizedDataset) -> str:
    """``"blake2b-128/v1:<32 hex digits>"`` over every tensor of ``dataset`` (name, dtype, shape, then its bytes).

    Token ids, labels (so a different mask is other data) and the row layout all count; the rows' order in memory
    counts too, which is what the data position of a resume refers to. Hashing streams the tensors' own buffers
    (no copy for contiguous CPU tensors): about 1 GB/s on one core, so a 400 MB dataset costs ~0.5 s.
    """
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(dataset.tensors):
        tensor = dataset.tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy() if tensor.numel() else b"")
    return f"{FINGERPRINT_SCHEME}:{digest.hexdigest()}"
