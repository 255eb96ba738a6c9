"""Ending a worker process after it has left the process group, without Python's interpreter teardown.

After the last collective, gloo's worker thread (``pt_gloo_runloop``) can still be releasing that work when the main
thread is already in ``Py_FinalizeEx``. Freeing the work's tensors takes the GIL; during finalization the thread is
told to exit instead, the forced unwind crosses a noexcept destructor, and ``std::terminate`` aborts the process
(SIGABRT, "terminate called without an active exception"): torchrun then reports a run whose work was all done as
failed. ``destroy_process_group`` does not join those threads, and a barrier before it only narrows the moment
(``benchmarks/gloo_exit_abort.py``; pytorch/pytorch#179291 describes the same crash). A worker whose files are written
and whose metric sinks are closed therefore flushes what it printed and ends with ``os._exit``: no finalization, so
no such moment.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Flush stdout, stderr and the logging handlers, then end the process with ``code`` at once (atexit handlers and
    Python's teardown are skipped: call it only when everything the process owns is written and closed)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream has nothing left to write
            pass
    os._exit(code)


#: How gloo and NCCL say that the process at the other end of a collective is gone.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted",
              "remote process exited or there was a network error")


def peer_lost(err: BaseException) -> bool:
    """Whether `err` (a collective's failure) says that another rank's process ended: that rank's own output says
    why, and this one has nothing to add but one line."""
    return isinstance(err, RuntimeError) and any(sign in str(err) for sign in _PEER_LOST)
