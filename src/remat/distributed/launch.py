"""Starting worker processes with torchrun (``torch.distributed.run``), from the ``remat`` command line.

``remat finetune RECIPE --nproc-per-node N [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT ...]`` becomes
``torchrun --nproc-per-node N ... -m remat.cli finetune RECIPE [overrides]``: torchrun starts and supervises the
workers, each of which finds itself under torchrun and trains instead of launching again. A single node without a
rendezvous endpoint uses ``--standalone`` (a free local port, so concurrent runs do not collide).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, fields

from remat._child import SAFE_PYTHON_FLAGS
from remat.errors import ConfigError

logger = logging.getLogger(__name__)

#: --nproc-per-node values torchrun accepts besides a positive integer.
NPROC_KEYWORDS: tuple[str, ...] = ("auto", "gpu", "cpu")
MAX_PORT = 65535
_HOST = re.compile(r"^[\w.:-]+$")


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

    def check(self) -> None:
        """ConfigError naming the flag and what is allowed for a value torchrun would fail on, or wait forever with
        (a node rank outside ``--nnodes``): checked before anything is launched."""
        max_nodes = parse_nnodes(self.nnodes) if self.nnodes is not None else 1
        if self.node_rank is not None and not 0 <= self.node_rank < max_nodes:
            nodes = f"--nnodes {self.nnodes}" if self.nnodes is not None else "one node (no --nnodes)"
            raise ConfigError(f"--node-rank: got {self.node_rank}, but the launch has {nodes}; allowed: "
                              f"{'0' if max_nodes == 1 else f'0 .. {max_nodes - 1}'}, a different rank on each node")
        if self.master_port is not None and not 1 <= self.master_port <= MAX_PORT:
            raise ConfigError(f"--master-port: got {self.master_port}; allowed: a port in 1 .. {MAX_PORT}")
        if self.max_restarts is not None and self.max_restarts < 0:
            raise ConfigError(f"--max-restarts: got {self.max_restarts}; allowed: 0 or more restarts")
        if self.rdzv_endpoint is not None:
            parse_endpoint(self.rdzv_endpoint)

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
                            "checkpoint). Default 0, except under activation_checkpointing: auto on several "
                            "processes: activation_checkpointing.max_replans, so that an out-of-memory error on one rank is "
                            "re-planned after a restart")


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

    options.check()
    check_port_free(options)
    share_store_off(options)
    if "OMP_NUM_THREADS" not in os.environ and options.nproc_per_node not in (None, "1"):
        # torchrun's own default for several workers per node, set here so that it does not print its 4-line banner
        # about it at every start
        os.environ["OMP_NUM_THREADS"] = "1"
    argv = [*options.torchrun_args(), *worker_command(worker_args)]
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


def check_port_free(options: LaunchOptions) -> None:
    """ConfigError naming ``--master-port`` when this node is to serve the rendezvous on a port that is taken (torchrun
    would fail with a traceback of its store); other nodes and ports chosen by torchrun are not checked."""
    port = options.master_port
    if port is None or options.node_rank not in (None, 0):
        return
    if options.master_addr not in (None, "localhost", "127.0.0.1", "::1", socket.gethostname()):
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("", port))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                return
            raise ConfigError(f"--master-port: port {port} is already in use on this machine (another run?); "
                              "allowed: a free port, or leave --master-port out and a free one is chosen") from None


def worker_command(python_args: Sequence[str]) -> list[str]:
    """torchrun's tail that starts each worker as ``python -P -u <python_args>``: ``-P`` keeps the working directory
    off the worker's import path, so a ``yaml.py`` or ``torch.py`` lying where the user ran the command is never
    imported in place of the real module (``python -m`` would put that directory first). torchrun's own ``-m`` has
    no way to pass an interpreter flag, hence ``--no-python`` with the interpreter named (``PYTHON_EXEC`` honoured,
    as torchrun honours it)."""
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    return ["--no-python", python, *SAFE_PYTHON_FLAGS, *python_args]


def stop_with_launcher(interval_s: float = 1.0) -> threading.Thread:
    """In a worker: a daemon thread that sends this process SIGTERM once its parent (the launcher: ``remat`` or
    torchrun) is gone, so a ``kill -9`` of the launcher does not leave orphans holding the devices and the run's lock.
    SIGTERM is the stop a run already answers: finish the step, save, release the lock, exit 143. Polling the
    parent's pid is portable; Linux's parent-death signal fires when the launching *thread* ends, which is not the
    launcher's death under torchrun's agent."""
    global _WATCH
    if _WATCH is not None and _WATCH.is_alive():
        return _WATCH  # one watch per process (remat.cli starts it first thing in a worker)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        logger.warning("the launcher (pid %d) is gone: stopping after the current step", parent)
        os.kill(os.getpid(), signal.SIGTERM)  # before the run's handler is in place, SIGTERM simply ends the worker

    _WATCH = threading.Thread(target=watch, name="remat-launcher-watch", daemon=True)
    _WATCH.start()
    return _WATCH


_WATCH: threading.Thread | None = None


def share_store_off(options: LaunchOptions, environ: MutableMapping[str, str] | None = None) -> bool:
    """For restarts over several nodes, give each rendezvous round a new store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    in the launcher's environment, unless set): torchrun otherwise hands every generation one shared store, whose
    keys from the previous generation break the next setup (see `remat.distributed.rendezvous`; on one node the
    workers prefix their keys by restart instead). Returns whether it was set."""
    env = os.environ if environ is None else environ
    several_nodes = options.nnodes is not None and parse_nnodes(options.nnodes) > 1
    if not (several_nodes and options.max_restarts) or "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in env:
        return False
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    logger.info("restarts over several nodes: each rendezvous round gets a new store "
                "(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)")
    return True


def parse_nnodes(value: str) -> int:
    """The largest node count ``--nnodes`` allows (``N`` or ``MIN:MAX``, 1 <= MIN <= MAX); ConfigError otherwise."""
    parts = value.split(":")
    if len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts):
        low, high = int(parts[0]), int(parts[-1])
        if 1 <= low <= high:
            return high
    raise ConfigError(f"--nnodes: got {value!r}; allowed: a positive number of nodes N, or MIN:MAX with "
                      "1 <= MIN <= MAX")


def parse_endpoint(value: str) -> tuple[str, int | None]:
    """``HOST``, ``HOST:PORT`` or ``[IPv6]:PORT`` of ``--rdzv-endpoint`` as (host, port or None); ConfigError
    naming the flag otherwise."""
    allowed = f"HOST or HOST:PORT (e.g. node0:29500, [::1]:29500), with a port in 1 .. {MAX_PORT}"
    text = value.strip()
    if text.startswith("[") and "]" in text:
        host, _, rest = text[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ConfigError(f"--rdzv-endpoint: got {value!r}; allowed: {allowed}")
        port_text = rest[1:] if rest else None
    else:
        host, sep, port_text_or_empty = text.rpartition(":") if ":" in text else (text, "", "")
        port_text = port_text_or_empty if sep else None
    if not host or not _HOST.match(host):
        raise ConfigError(f"--rdzv-endpoint: got {value!r}, which names no host; allowed: {allowed}")
    if port_text is None:
        return host, None
    if not port_text.isdigit() or not 1 <= int(port_text) <= MAX_PORT:
        raise ConfigError(f"--rdzv-endpoint: got {value!r}, whose port {port_text!r} is not a port; allowed: "
                          f"{allowed}")
    return host, int(port_text)


def _nproc(value: str) -> str:
    if value in NPROC_KEYWORDS or (value.isdigit() and int(value) >= 1):
        return value
    allowed = ", ".join(NPROC_KEYWORDS)
    raise argparse.ArgumentTypeError(f"got {value!r}; allowed: a positive integer or one of {allowed}")
