"""How often a 2-rank gloo job dies at exit after its work is done: SIGABRT, "terminate called without an active
exception", one rank, after ``destroy_process_group`` returned on both.

Each try runs ``python -m torch.distributed.run --standalone --nproc-per-node 2`` on a minimal worker: DDP over a
linear layer, 3 steps, an all-reduce, then rank 0 busy for ``--busy-s`` seconds (as rank 0 drawing the run's report),
optionally a barrier (``--barrier``), ``destroy_process_group``, and a normal exit or (``--exit-now``)
``remat.distributed.exit.exit_now``, which skips Python's teardown; ``remat finetune``'s workers do both. A try fails
when torchrun exits non-zero; the output of failed tries is kept.

Found with gdb (2026-11-23, torch 2.13.0+cpu): the aborting thread is gloo's ``pt_gloo_runloop``, releasing the last
reference to a finished ``AsyncBarrierWork`` (an ``AsyncAllreduceWork``): freeing its tensors decrefs their Python
objects, which takes the GIL while the main thread is in ``Py_FinalizeEx``; the thread is told to exit
(``PyThread_exit_thread``), the forced unwind crosses a noexcept destructor, and ``std::terminate`` aborts the
process. ``destroy_process_group`` does not stop or join those threads, so the barrier narrows the window (rank 0 is
no longer busy) but the last collective is still released in the background while Python shuts down;
``exit_now`` leaves no Python teardown for it to collide with.

    OMP_NUM_THREADS=1 python benchmarks/gloo_exit_abort.py --tries 12 [--barrier] [--exit-now] [--busy-s 1.0]

Results: ``benchmarks/results/gloo_exit_abort.md``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
WORKER = """\
import os, time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
for _ in range(3):
    model(torch.randn(8, 64)).sum().backward()
dist.all_reduce(torch.ones(4))
if rank == 0:
    end = time.monotonic() + float(os.environ["BUSY_S"])
    while time.monotonic() < end:
        pass
if os.environ["BARRIER"] == "1":
    dist.barrier()
dist.destroy_process_group()
print(f"rank {rank} left the process group", flush=True)
if os.environ["EXIT_NOW"] == "1":
    from remat.distributed.exit import exit_now

    exit_now(0)
"""

ABORT = "terminate called without an active exception"


def run_try(worker: Path, barrier: bool, exit_now: bool, busy_s: float,
            timeout_s: float) -> tuple[int | None, str]:
    """One torchrun launch: (its exit status, None when it outlived `timeout_s`; its output)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BARRIER": "1" if barrier else "0", "BUSY_S": str(busy_s),
           "EXIT_NOW": "1" if exit_now else "0",
           "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(worker)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        return None, f"{err.stdout or ''}{err.stderr or ''}"
    return done.returncode, done.stdout + done.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tries", type=int, default=12)
    parser.add_argument("--barrier", action="store_true", help="both ranks meet at a barrier before leaving")
    parser.add_argument("--exit-now", action="store_true",
                        help="end each rank with remat.distributed.exit.exit_now after leaving (what remat finetune's "
                             "workers do)")
    parser.add_argument("--busy-s", type=float, default=1.0, help="rank 0's busy moment after the last collective")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gloo-exit-"))
    worker = work / "worker.py"
    worker.write_text(WORKER)
    failed = 0
    for index in range(args.tries):
        start = time.monotonic()
        code, text = run_try(worker, args.barrier, args.exit_now, args.busy_s, args.timeout_s)
        seconds = time.monotonic() - start
        if code == 0:
            print(f"try {index}: ok, {seconds:.0f} s", flush=True)
            continue
        failed += 1
        log = work / f"try_{index:02d}.log"
        log.write_text(text)
        what = "hung" if code is None else f"exit {code}" + (" (a rank aborted at exit)" if ABORT in text else "")
        print(f"try {index}: {what}, {seconds:.0f} s; output in {log}", flush=True)
    print(f"barrier {'yes' if args.barrier else 'no'}, exit_now {'yes' if args.exit_now else 'no'}, rank 0 busy "
          f"{args.busy_s:g} s: {failed} of {args.tries} tries failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
