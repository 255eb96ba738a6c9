"""The ``remat`` command line. Each subcommand lives in ``remat.commands.<name>``.

User mistakes (``remat.errors.RematError``) are printed as one message without a traceback and exit with status 2;
faults of the machine (a full disk, a read-only file system, an I/O error) as one line with status 1.
"""

from __future__ import annotations

import os

# OpenMP's default active spin-wait collapses torch's CPU threads when another process holds a core: measured on a
# 2-core machine, a tiny Llama forward+backward went from 0.42 s to 4.4 s with 2 threads. A passive wait costs little
# when the cores are free. It must be set before torch loads OpenMP (nothing above imports torch: `remat` imports
# lazily), and torchrun's workers inherit it; a value the user set is kept. Only the command line sets it: a program
# that imports remat keeps its own environment.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A worker that remat's launcher (torchrun) started watches its launcher from its first instruction, before the
# seconds its imports take: a kill -9 of the launcher while the workers still start must not leave them running
# (remat.distributed.launch.stop_with_launcher; it imports the standard library only).
if all(name in os.environ for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")):
    from remat.distributed.launch import stop_with_launcher  # noqa: E402

    stop_with_launcher()

import argparse  # noqa: E402
import errno  # noqa: E402
import importlib  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from remat import __version__  # noqa: E402
from remat._files import disk_full_error, is_disk_full, printable  # noqa: E402
from remat.errors import MachineFault, RematError  # noqa: E402

#: Faults of the machine rather than of the input: one line and exit status 1, not a traceback.
ENVIRONMENT_FAULTS: frozenset[int] = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})

COMMANDS: tuple[str, ...] = ("finetune", "estimate", "plan", "profile", "report", "recipes")


def _command_modules() -> dict[str, ModuleType]:
    return {name: importlib.import_module(f"remat.commands.{name}") for name in COMMANDS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="remat",
        description="remat: memory-efficient fine-tuning of causal LMs (activation checkpointing, fused loss).",
    )
    parser.add_argument("--version", action="version", version=f"remat {__version__}")
    _add_log_level(parser, default="INFO")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _command_modules().values():
        module.register(sub)
    for command_parser in sub.choices.values():  # `remat finetune r.yaml --log-level DEBUG` works too
        _add_log_level(command_parser, default=argparse.SUPPRESS)
    return parser


def _add_log_level(parser: argparse.ArgumentParser, *, default: str) -> None:
    parser.add_argument("--log-level", default=default, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="verbosity of remat's own log messages (default INFO)")


#: Options whose value is a size: ``--budget -1GiB`` is that value (refused with the size rules), not an unknown flag.
SIZE_OPTIONS: tuple[str, ...] = ("--budget", "--fits", "--memory-budget")


def _sizes_joined(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--budget -1GiB`` written ``--budget=-1GiB``: argparse takes a value that starts with '-' and
    is not a plain number for an option, and would answer "expected one argument"."""
    out: list[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        if items[i] in SIZE_OPTIONS and i + 1 < len(items) and items[i + 1][:1] == "-" and items[i + 1][1:2].isdigit():
            out.append(f"{items[i]}={items[i + 1]}")
            i += 2
            continue
        out.append(items[i])
        i += 1
    return out


#: Libraries whose loggers print through a handler of their own (so a propagated copy would print each line twice).
LIBRARIES_WITH_OWN_HANDLERS: tuple[str, ...] = ("huggingface_hub", "datasets", "transformers")


def _not_an_enum_registration(record: logging.LogRecord) -> bool:
    return "is an Enum subclass and is now natively supported" not in record.getMessage()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(_sizes_joined(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=getattr(logging, args.log_level), format="[remat] %(levelname)s %(message)s",
                        stream=sys.stderr)
    for library in LIBRARIES_WITH_OWN_HANDLERS:  # their lines once, as they print them, not again under [remat]
        logging.getLogger(library).propagate = False
    # torchao (imported by transformers whenever it is installed) warns at import about each CUDA kernel library it
    # cannot load, on every machine without those GPUs, and registers enums torch now handles itself; its errors
    # and torch's other warnings still show.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").addFilter(_not_an_enum_registration)
    # torchao's QAT layers (qat.enabled) name their int4 dtype by a type torchao itself deprecates: nothing to act on
    warnings.filterwarnings("ignore", message="Deprecation: TorchAODType is deprecated", category=UserWarning)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(_command_modules()[args.command].run(args, extra))
    except MachineFault as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except RematError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if err.errno not in ENVIRONMENT_FAULTS:
            raise
        where = f" ({printable(str(err.filename))})" if err.filename else ""
        kept = ("the run stopped; checkpoints are written to a temporary directory and published only when complete, "
                "so the last complete one is intact") if args.command == "finetune" else "nothing was changed"
        print(f"error: {os.strerror(err.errno)}{where}: {kept}", file=sys.stderr)
        return 1
    except Exception as err:  # noqa: BLE001 (re-raised unless the disk is full)
        if not is_disk_full(err):
            raise
        print(f"error: {disk_full_error(err, Path.cwd())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: stopped at once (the last complete checkpoint is kept)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
