"""Seeing `torch.UntypedStorage.resize_`, which no dispatch mode sees.

FSDP2 frees and re-allocates unsharded parameters by resizing their storages in place
(`storage.resize_(0)` / `storage.resize_(n)`). That call does not go through the dispatcher, so a
`TorchDispatchMode` never sees it. While at least one listener is subscribed, `UntypedStorage.resize_` is
replaced by a wrapper that calls the original and then tells every listener which storage changed size; the
original method is put back when the last listener leaves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

ResizeListener = Callable[[torch.UntypedStorage], None]

_lock = threading.Lock()
_listeners: list[ResizeListener] = []
_original_resize: Any = None


def _resize_and_notify(storage: torch.UntypedStorage, size: int) -> Any:
    result = _original_resize(storage, size)
    for listener in tuple(_listeners):
        listener(storage)
    return result


def subscribe(listener: ResizeListener) -> None:
    """Call `listener(storage)` after every `UntypedStorage.resize_` until `unsubscribe(listener)`."""
    global _original_resize
    with _lock:
        if not _listeners:
            _original_resize = torch.UntypedStorage.resize_
            torch.UntypedStorage.resize_ = _resize_and_notify  # type: ignore[method-assign]
        _listeners.append(listener)


def unsubscribe(listener: ResizeListener) -> None:
    """Stop notifying `listener`; restores the original `resize_` when no listener is left."""
    global _original_resize
    with _lock:
        if listener in _listeners:
            _listeners.remove(listener)
        if not _listeners and _original_resize is not None:
            torch.UntypedStorage.resize_ = _original_resize  # type: ignore[method-assign]
            _original_resize = None
