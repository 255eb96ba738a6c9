"""A second process for the one-writer tests: ``python lock_holder.py DIR...`` takes the run locks of DIRs as a run
would, prints ``ready`` and holds them until its stdin closes (or it is killed)."""

from __future__ import annotations

import sys
from pathlib import Path

from remat.recipes.run_safety.run_lock import acquire_run_locks


def main() -> None:
    locks = acquire_run_locks({f"dir{i}": Path(arg) for i, arg in enumerate(sys.argv[1:])})
    print(f"ready attempt {locks.attempt}", flush=True)
    sys.stdin.read()
    locks.release()


if __name__ == "__main__":
    main()
