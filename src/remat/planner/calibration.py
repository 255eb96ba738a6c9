"""The device throughput the planner prices recompute at, measured by `remat profile` and read back by `remat plan
--calibration PATH` and a recipe's ``activation_checkpointing.calibration``.

The planner predicts a plan's recompute time as its counted recompute FLOPs divided by ``flops_per_second``
(`remat.planner.planner.DEFAULT_FLOPS_PER_SECOND` without a calibration). `fit_flops_per_second` fits that number
from real steps: each profiled setting's median step time minus the un-checkpointed one (``none``) is the time its
recompute took, and the FLOP counter gives what it recomputed on the same step; the least-squares line through the
origin, extra seconds = recompute FLOPs / throughput, gives the throughput (``method: recompute-fit``). It is what
recompute really costs on the device, memory-bound element-wise ops included (they count zero FLOPs but take time).
When the step times are too noisy for a positive slope (tiny models on a busy CPU), the whole un-checkpointed step's
counted FLOPs over its median time is used instead and said so (``method: whole-step``).

By op class (``method: recompute-fit-by-class``): each profiled step also counts the bytes its memory-bound ops
write (`remat.planner.measure.count_ops`), and the extra time is fitted as ``extra FLOPs / flops_per_second + extra
bytes / memory_bytes_per_second`` (least squares through the origin in both reciprocals). When both come out
positive, both are kept and the planner prices recompute by class (`remat.planner.timing.RecomputeRates`); else the
one-number fit above is used. A calibration written before the classes were counted has no
``memory_bytes_per_second`` and prices FLOPs alone.

This module loads neither torch nor transformers.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from remat._files import read_regular_bytes, write_atomic
from remat.errors import ConfigError

METHODS: Final[tuple[str, ...]] = ("recompute-fit-by-class", "recompute-fit", "whole-step")
TARGETS: Final[tuple[str, ...]] = ("cuda", "cpu")
_REQUIRED: Final[tuple[str, ...]] = ("device", "target", "torch_version", "flops_per_second", "date", "method")


@dataclass(frozen=True)
class Calibration:
    """A measured throughput: ``flops_per_second`` on ``device`` (``target`` cuda or cpu) with ``torch_version``,
    measured on ``date`` (ISO) by ``method`` (one of `METHODS`); ``details``: the samples it was fitted from."""

    device: str
    target: str
    torch_version: str
    flops_per_second: float
    date: str
    method: str
    details: dict[str, Any] = field(default_factory=dict)
    memory_bytes_per_second: float | None = None
    """The rate memory-bound ops write at (``recompute-fit-by-class``); None: not fitted."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)

    def describe(self) -> str:
        """One line: throughput(s), device, method and date."""
        memory = (f", memory-bound ops {self.memory_bytes_per_second / 1e9:.3g} GB/s"
                  if self.memory_bytes_per_second is not None else "")
        return (f"{self.flops_per_second / 1e12:.3g} TFLOP/s{memory} on {self.device} (torch {self.torch_version}, "
                f"{self.method}, {self.date})")


@dataclass(frozen=True)
class TimingSample:
    """One profiled setting for the fit: its median step time and the FLOPs its step counted (all micro-batches)."""

    label: str
    median_step_s: float
    step_flops: int
    step_memory_bytes: int = 0
    """Bytes the step's memory-bound ops wrote (0: not counted)."""


def fit_flops_per_second(samples: Sequence[TimingSample], *, baseline: str = "none") -> tuple[float, str,
                                                                                                dict[str, Any]]:
    """(flops_per_second, method, details) from profiled settings, ``baseline`` (no checkpointing) among them; see
    the module docstring. Raises `ConfigError` without the baseline or with a baseline that counted no FLOPs."""
    base = next((s for s in samples if s.label == baseline), None)
    if base is None:
        raise ConfigError(f"--write-calibration: needs {baseline!r} among --policies (the step without recompute that "
                          "the others' extra time is measured against)")
    if base.step_flops <= 0 or base.median_step_s <= 0:
        raise ConfigError(f"--write-calibration: the {baseline!r} step counted {base.step_flops} FLOPs in "
                          f"{base.median_step_s} s; nothing to fit")
    points = [{"label": s.label, "recompute_flops": s.step_flops - base.step_flops,
               "extra_s": round(s.median_step_s - base.median_step_s, 6)}
              for s in samples if s is not base and s.step_flops > base.step_flops]
    whole_step = base.step_flops / base.median_step_s
    details: dict[str, Any] = {"baseline": baseline, "baseline_step_s": base.median_step_s,
                               "baseline_step_flops": base.step_flops, "whole_step_flops_per_second": whole_step,
                               "points": points}
    numerator = sum(p["recompute_flops"] * p["extra_s"] for p in points)
    denominator = sum(p["recompute_flops"] ** 2 for p in points)
    if numerator > 0 and denominator > 0:
        fitted = denominator / numerator  # extra_s = flops / fps, least squares through the origin in 1/fps
        details["recompute_fit_flops_per_second"] = fitted
        return fitted, "recompute-fit", details
    details["note"] = ("no setting recomputed FLOPs in measurably more time than the baseline (noisy or too few "
                       "steps): the whole un-checkpointed step's FLOPs over its median time are used instead")
    return whole_step, "whole-step", details


def fit_by_class(samples: Sequence[TimingSample], *, baseline: str = "none") -> tuple[float, float] | None:
    """(flops_per_second, memory_bytes_per_second) fitted from the extra time, FLOPs and memory-bound bytes of each
    setting over ``baseline`` (module docstring); None when the samples do not give both positive (too few settings,
    bytes not counted, noise)."""
    base = next((s for s in samples if s.label == baseline), None)
    if base is None:
        return None
    rows = [(s.step_flops - base.step_flops, s.step_memory_bytes - base.step_memory_bytes,
             s.median_step_s - base.median_step_s) for s in samples if s is not base]
    ff = sum(f * f for f, _, _ in rows)
    fb = sum(f * b for f, b, _ in rows)
    bb = sum(b * b for _, b, _ in rows)
    fe = sum(f * e for f, _, e in rows)
    be = sum(b * e for _, b, e in rows)
    determinant = ff * bb - fb * fb
    if len(rows) < 2 or determinant <= 1e-9 * max(ff * bb, 1.0):
        return None
    per_flop = (fe * bb - be * fb) / determinant  # seconds per FLOP
    per_byte = (ff * be - fb * fe) / determinant  # seconds per byte
    if per_flop <= 0 or per_byte <= 0:
        return None
    return 1.0 / per_flop, 1.0 / per_byte


def make_calibration(samples: Sequence[TimingSample], *, device: str, target: str, torch_version: str,
                     baseline: str = "none") -> Calibration:
    """A `Calibration` fitted from ``samples`` (see `fit_by_class`, else `fit_flops_per_second`), dated now
    (UTC)."""
    fps, method, details = fit_flops_per_second(samples, baseline=baseline)
    by_class = fit_by_class(samples, baseline=baseline)
    memory: float | None = None
    if by_class is not None:
        details["one_number_fit"] = {"flops_per_second": fps, "method": method}
        (fps, memory), method = by_class, "recompute-fit-by-class"
        details["memory_bytes_points"] = {s.label: s.step_memory_bytes for s in samples}
    return Calibration(device=device, target=target, torch_version=torch_version, flops_per_second=fps,
                       date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), method=method,
                       details=details, memory_bytes_per_second=memory)


def write_calibration(calibration: Calibration, path: str | Path) -> Path:
    """Write ``calibration`` as JSON to ``path`` (folders made as needed)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(calibration.to_dict(), indent=2) + "\n", "calibration file")
    return out


#: The largest calibration file read (what `remat profile --write-calibration` writes is under 1 KiB).
CALIBRATION_LIMIT = 1 << 20


def read_calibration(path: str | Path, *, key: str = "--calibration") -> Calibration:
    """The calibration in ``path``; `ConfigError` naming ``key`` for a missing, unreadable or malformed file."""
    where = f"{key}: {str(path)!r}"
    if not Path(path).exists():
        raise ConfigError(f"{where} does not exist; write one with `remat profile RECIPE --write-calibration "
                          f"{path}`")
    try:  # a regular file of bounded size: a FIFO or a device in its place is one line, not a hang
        data = json.loads(read_regular_bytes(path, key, limit=CALIBRATION_LIMIT))
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{where} cannot be read ({err})") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where} is not JSON ({err}); expected what `remat profile --write-calibration` "
                          "writes") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where} holds a {type(data).__name__}; expected a JSON object with keys "
                          f"{', '.join(_REQUIRED)}")
    missing = [name for name in _REQUIRED if name not in data]
    if missing:
        raise ConfigError(f"{where} lacks {', '.join(missing)}; expected the keys {', '.join(_REQUIRED)} (as "
                          "`remat profile --write-calibration` writes)")
    fps = data["flops_per_second"]
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
        raise ConfigError(f"{where}: flops_per_second is {fps!r}; allowed: a finite number > 0")
    if data["target"] not in TARGETS:
        raise ConfigError(f"{where}: target is {data['target']!r}; allowed: {', '.join(TARGETS)}")
    if data["method"] not in METHODS:
        raise ConfigError(f"{where}: method is {data['method']!r}; allowed: {', '.join(METHODS)}")
    for name in ("device", "torch_version", "date"):
        if not isinstance(data[name], str):
            raise ConfigError(f"{where}: {name} is {data[name]!r}; allowed: a string")
    details = data.get("details", {})
    memory = data.get("memory_bytes_per_second")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, (int, float))
                               or not math.isfinite(memory) or memory <= 0):
        raise ConfigError(f"{where}: memory_bytes_per_second is {memory!r}; allowed: a finite number > 0 or null")
    return Calibration(device=data["device"], target=data["target"], torch_version=data["torch_version"],
                       flops_per_second=float(fps), date=data["date"], method=data["method"],
                       details=details if isinstance(details, dict) else {},
                       memory_bytes_per_second=float(memory) if memory is not None else None)


def calibrated_rates(path: str | Path, target: str, *, key: str) -> tuple[float, float | None]:
    """(flops_per_second, memory_bytes_per_second or None) in the calibration at ``path`` for planning on
    ``target``; `ConfigError` naming ``key`` when the file is malformed or was measured on the other target (a CPU's
    throughput says nothing of a GPU's)."""
    calibration = read_calibration(path, key=key)
    if calibration.target != target:
        raise ConfigError(f"{key}: {str(path)!r} was measured on {calibration.target} ({calibration.device}) but "
                          f"this plan is for {target}; profile on the {target} (remat profile --write-calibration) "
                          "or drop the calibration")
    return calibration.flops_per_second, calibration.memory_bytes_per_second
