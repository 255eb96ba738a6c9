"""Starting worker processes with torchrun (``torch.distributed.run``), from the ``remat`` command line.

``remat finetune RECIPE --nproc-per-node N [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT ...]`` becomes
``torchrun --nproc-per-node N ... -m remat.cli finetune RECIPE [overrides]``: torchrun starts and supervises the
workers, each of which finds itself under torchrun and trains instead of launching again. A single node without a
rendezvous endpoint uses ``--standalone`` (a free local port, so concurrent runs do not collide).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from remat.errors import ConfigError

logger = logging.getLogger(__name__)

#: --nproc-per-node values torchrun accepts besides a positive integer.
NPROC_KEYWORDS: tuple[str, ...] = ("auto", "gpu", "cpu")


@dataclass(frozen=True)
class LaunchOptions:
    """The torchrun options of a command line (None: not given). Flag names are torchrun's (``--node-rank``...)."""

    nproc_per_node: str | None = None
    nnodes: str | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int | None = None

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> LaunchOptions:
        """The options `add_launch_arguments` put on a parsed namespace."""
        return cls(**{f.name: getattr(args, f.name, None) for f in fields(cls)})

    @property
    def requested(self) -> bool:
        """Whether any launch option was given (then the command runs under torchrun)."""
        return any(getattr(self, f.name) is not None for f in fields(self))

    def num_processes(self) -> int | None:
        """Total workers over all nodes, when both counts are plain integers (else torchrun decides)."""
        nproc, nodes = self.nproc_per_node or "1", self.nnodes or "1"
        return int(nproc) * int(nodes) if nproc.isdigit() and nodes.isdigit() else None

    def torchrun_args(self) -> list[str]:
        """torchrun's own arguments (before the module to run)."""
        args: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                args += [f"--{f.name.replace('_', '-')}", str(value)]
        single_node = self.nnodes in (None, "1")
        if single_node and self.rdzv_endpoint is None and self.master_addr is None and self.master_port is None:
            args.append("--standalone")
        return args


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the torchrun options to a subcommand's parser (in their own help group)."""
    group = parser.add_argument_group(
        "launch (torchrun)", "start several worker processes through torch.distributed.run; ignored (but checked) "
        "when the command already runs under torchrun")
    group.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=_nproc, metavar="N",
                       help="worker processes on this node: an integer, or auto | gpu | cpu (torchrun's meaning)")
    group.add_argument("--nnodes", metavar="N|MIN:MAX", help="number of nodes (default 1)")
    group.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, metavar="R",
                       help="rank of this node (static rendezvous)")
    group.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", metavar="HOST:PORT",
                       help="rendezvous address every node reaches (e.g. node 0's host and a free port)")
    group.add_argument("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", metavar="NAME",
                       help="rendezvous backend: static (default, with --node-rank) or c10d")
    group.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", metavar="ID", help="job id for c10d rendezvous")
    group.add_argument("--master-addr", "--master_addr", dest="master_addr", metavar="HOST",
                       help="static rendezvous: address of node 0")
    group.add_argument("--master-port", "--master_port", dest="master_port", type=int, metavar="PORT",
                       help="static rendezvous: port on node 0")
    group.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, metavar="K",
                       help="restart the workers up to K times on failure (resume: auto continues from the latest "
                            "checkpoint)")


def check_launch_environment(options: LaunchOptions, environ: Mapping[str, str] | None = None) -> bool:
    """True when workers must be launched; False when already under torchrun (its own numbers win, and a
    contradicting ``--nproc-per-node`` is a ConfigError)."""
    from remat.distributed.env import under_torchrun

    if not options.requested:
        return False
    if not under_torchrun(environ):
        return True
    env = os.environ if environ is None else environ
    nproc = options.nproc_per_node
    if nproc is not None and nproc.isdigit() and int(nproc) != int(env["LOCAL_WORLD_SIZE"]):
        raise ConfigError(f"--nproc-per-node: got {nproc}, but this process already runs under torchrun with "
                          f"LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']}; allowed: leave it out, or the same number")
    logger.info("already running under torchrun (RANK=%s of WORLD_SIZE=%s): not launching again",
                env.get("RANK"), env.get("WORLD_SIZE"))
    return False


def launch(options: LaunchOptions, worker_args: Sequence[str]) -> int:
    """Run ``torchrun <options> <worker_args>`` in this process; returns 0, the first failed worker's exit code, or
    128 + the signal number when the launcher was stopped by a signal (which torchrun forwards to the workers).

    ``worker_args`` is what each worker runs, e.g. ``["-m", "remat.cli", "finetune", "recipe.yaml"]``.
    """
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    argv = [*options.torchrun_args(), *worker_args]
    logger.info("launching: torchrun %s", " ".join(argv))
    try:
        torchrun.main(argv)
    except ChildFailedError as err:
        codes = [failure.exitcode for failure in err.failures.values()]
        return next((code for code in codes if code > 0), 1)
    except SignalException as err:
        # torchrun passed the signal on to the workers (which finish their step and save) before raising this.
        logger.warning("stopped by %s: the workers were asked to stop", signal.Signals(err.sigval).name)
        return 128 + int(err.sigval)
    return 0


def _nproc(value: str) -> str:
    if value in NPROC_KEYWORDS or (value.isdigit() and int(value) >= 1):
        return value
    allowed = ", ".join(NPROC_KEYWORDS)
    raise argparse.ArgumentTypeError(f"got {value!r}; allowed: a positive integer or one of {allowed}")
