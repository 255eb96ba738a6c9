"""The numerics guard: a step whose loss or gradient norm is NaN or infinite never reaches the weights, and no
training state holding NaN or infinite values is saved or resumed from.

- `nonfinite_flag` (in `remat.recipes.step.train_step`, before the optimizer step): one 0-dim float32 tensor on the
  loss's device, 1.0 when the step's loss on any rank or its global gradient norm is not finite. It reads no value on
  the host; under ddp/fsdp2 it costs one all-reduce (MAX) of that one element over all ranks, so that every rank
  skips together (the gradient norm is already global, a rank's loss is not).
- `step_unless`: the optimizer step, not applied when the flag is set. Optimizers that accept GradScaler's
  ``found_inf`` (``_step_supports_amp_scaling``: torch's ``fused=True`` Adam, AdamW, SGD, Adagrad) get the flag as
  ``found_inf`` and skip on the device: weights, moments and step counts stay as they were, with no host sync. Any
  other optimizer costs one host read of the flag, the only synchronisation the guard adds. On fake tensors (the
  memory estimate) the step is always taken, which is what the estimate prices.
- `NonFiniteGuard`: the run's policy (``training.on_nonfinite``, ``training.max_nonfinite_steps``) applied on the
  host after the step, from the values the step's log line reads anyway.
- `non_finite_tensors`: which parameters and optimizer-state tensors hold NaN or infinite values (one host read);
  `refuse_to_save` and `refuse_to_resume` turn that into one-line errors before a save and after a load.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from remat.errors import TrainingDivergedError

if TYPE_CHECKING:
    from remat.distributed import DistributedSetup
    from remat.recipes.config import TrainingConfig
    from remat.recipes.reports.reporting import StepRecord

_SHOWN = 3  # tensor names a message lists before "..."


def nonfinite_flag(loss: Tensor, grad_norm: Tensor, setup: DistributedSetup) -> Tensor:
    """1.0 when ``loss`` (this rank's) or ``grad_norm`` (global) is NaN/inf on any rank, else 0.0; a 0-dim float32
    tensor on ``loss``'s device, computed without a host sync (one one-element all-reduce when distributed)."""
    finite = torch.isfinite(loss) & torch.isfinite(grad_norm.to(loss.device, non_blocking=True))
    flag = (~finite).to(torch.float32)
    if setup.is_distributed and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips its own update given ``found_inf`` (the GradScaler protocol), so the guard needs
    no host sync."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_unless(optimizer: torch.optim.Optimizer, flag: Tensor) -> None:
    """``optimizer.step()``, not applied when ``flag`` (from `nonfinite_flag`) is set: on the device through
    ``found_inf`` where the optimizer supports it, otherwise after one host read of ``flag``."""
    if skips_on_device(optimizer):
        optimizer.found_inf = flag  # type: ignore[attr-defined]  # read and removed as torch's GradScaler does
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
        return
    if is_fake(flag) or not bool(flag):
        optimizer.step()


@dataclass
class NonFiniteGuard:
    """The run's policy for steps whose update was not applied because they were non-finite.

    ``stop`` raises on the first one; ``skip`` goes on until more than ``max_consecutive`` come in a row (a finite
    step resets the count). Both say which step and where the last good checkpoint is."""

    policy: str
    max_consecutive: int
    consecutive: int = 0
    total: int = 0
    finite_seen: bool = False
    suspects: tuple[str, ...] = ()
    """Recipe values far outside any usual range, named when no step of the run was finite yet."""

    @classmethod
    def from_config(cls, cfg: TrainingConfig, suspects: tuple[str, ...] = ()) -> NonFiniteGuard:
        return cls(policy=cfg.on_nonfinite, max_consecutive=cfg.max_nonfinite_steps, suspects=suspects)

    def after_step(self, record: StepRecord, last_good: Path | None) -> str | None:
        """None after an applied step; the line to log after a skipped one; TrainingDivergedError when the policy
        stops the run."""
        if not record.skipped:
            self.consecutive = 0
            self.finite_seen = True
            return None
        self.consecutive += 1
        self.total += 1
        values = f"step {record.step}: loss {record.loss} and grad_norm {record.grad_norm}"
        if not self.finite_seen and self.suspects:  # from the first step on: the recipe itself is the likely cause
            values += f" (never finite in this run; out of any usual range: {'; '.join(self.suspects)})"
        if self.policy == "skip" and self.consecutive <= self.max_consecutive:
            return (f"{values}: not finite, so its update was not applied (weights and optimizer state unchanged; "
                    f"its batch is consumed and the lr schedule moves on); {self.consecutive} of at most "
                    f"{self.max_consecutive} such steps in a row (training.max_nonfinite_steps)")
        where = f"the last good checkpoint is {last_good}" if last_good is not None else "no checkpoint was saved yet"
        why = ("training.on_nonfinite: stop" if self.policy == "stop" else
               f"{self.consecutive} in a row, more than training.max_nonfinite_steps: {self.max_consecutive}")
        raise TrainingDivergedError(
            f"{values}: training diverged ({why}); the update was not applied and the run stops without saving "
            f"({where}). Lower optimizer.lr, keep clip_grad_norm.max_norm set"
            + (", check the data or set training.on_nonfinite: skip" if self.policy == "stop" else " or check the data")
            + "; then resume from that checkpoint"
        )


def non_finite_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                       setup: DistributedSetup | None = None) -> list[str]:
    """The names of ``model``'s parameters and buffers and of ``optimizer``'s state tensors that hold a NaN or an
    infinite value; empty when all are finite. One host read (the norms of all tensors, taken together). Sharded
    (DTensor) tensors are checked on this rank's shard; with ``setup`` the answer is agreed by all ranks (a collective:
    call it on every rank), naming "a tensor on another rank" where only another rank's shard is bad."""
    named = dict(_named_tensors(model, optimizer))
    names = list(named)
    tensors = [named[name] for name in names]
    bad: list[str] = []
    if tensors:
        # The 2-norm is torch's fast multi-tensor kernel (the max-abs one is ~30x slower on the CPU); NaN and inf
        # propagate into it. A finite tensor whose norm overflows (values beyond ~1e19) is told apart exactly.
        norms = torch._foreach_norm(tensors, 2)
        finite = torch.stack([n.float().to(norms[0].device) for n in norms]).isfinite().tolist()
        bad = [name for name, tensor, ok in zip(names, tensors, finite, strict=True)
               if not ok and not bool(torch.isfinite(tensor).all())]
    if setup is not None and setup.any_rank(bool(bad)) and not bad:
        bad = ["a tensor on another rank"]
    return bad


def refuse_to_save(step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                   setup: DistributedSetup | None, checkpoint_dir: Path) -> None:
    """TrainingDivergedError instead of a checkpoint of non-finite state (nothing written, nothing pruned)."""
    bad = non_finite_tensors(model, optimizer, setup)
    if bad:
        raise TrainingDivergedError(f"refusing to save checkpoint step_{step}: NaN or infinite values in "
                                    f"{_listed(bad)}; nothing was saved or pruned in {checkpoint_dir}")


def refuse_to_resume(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     setup: DistributedSetup | None) -> None:
    """TrainingDivergedError naming ``path`` when the state just loaded from it is not finite."""
    bad = non_finite_tensors(model, optimizer, setup)
    if bad:
        raise TrainingDivergedError(f"checkpoint {path} holds NaN or infinite values in {_listed(bad)}: refusing to "
                                    "resume from it; set checkpoint.resume to the path of an earlier step_N")


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return f"{len(names)} tensor(s) ({shown}{', ...' if len(names) > _SHOWN else ''})"


def _named_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterable[tuple[str, Tensor]]:
    """(name, local floating-point tensor) for every non-empty parameter, buffer and optimizer-state tensor; a 4-bit
    layer's packed weight is codes, not numbers (`remat.models.quantization.packed_weights`)."""
    from remat.models.quantization import packed_weights

    param_names = {id(p): name for name, p in model.named_parameters()}
    packed = packed_weights(model)
    items: list[tuple[str, Tensor]] = [(name, p) for name, p in model.named_parameters() if id(p) not in packed]
    items += list(model.named_buffers())
    if optimizer is not None:
        for param, state in optimizer.state.items():
            owner = param_names.get(id(param), "a parameter")
            items += [(f"optimizer state {key} of {owner}", value) for key, value in state.items()
                      if isinstance(value, Tensor)]
    for name, tensor in items:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if (local.is_floating_point() or local.is_complex()) and local.numel():
            yield name, local.detach()


#: (recipe key, test, what is usual) for values that make the first step non-finite however the data looks.
_USUAL: tuple[tuple[str, Any, str], ...] = (
    ("model.config.rope_theta", lambda v: v <= 0 or v > 1e9, "1e4 to 1e7"),
    ("model.config.rms_norm_eps", lambda v: v <= 0 or v > 0.1, "1e-6 to 1e-5"),
    ("model.config.layer_norm_eps", lambda v: v <= 0 or v > 0.1, "1e-6 to 1e-5"),
    ("model.config.initializer_range", lambda v: v > 1, "about 0.02"),
    ("optimizer.lr", lambda v: v > 1, "1e-5 to 1e-2"),
)


def unusual_settings(cfg: Any) -> tuple[str, ...]:
    """The recipe values (model config, lr, LoRA scale) far outside any usual range, as ``key = value (usual: ...)``,
    for the message of a run whose very first steps are not finite."""
    values: dict[str, Any] = {f"model.config.{k}": v for k, v in (cfg.model.config or {}).items()}
    values["optimizer.lr"] = cfg.optimizer.kwargs.get("lr")
    found = [f"{key} = {values[key]!r} (usual: {usual})" for key, test, usual in _USUAL
             if isinstance(values.get(key), (int, float)) and not isinstance(values[key], bool) and test(values[key])]
    peft = getattr(cfg, "peft", None)
    if peft is not None and peft.lora_alpha / peft.r > 64:
        found.append(f"peft.lora_alpha / peft.r = {peft.lora_alpha:g} / {peft.r} (usual: 1 to 4)")
    return tuple(found)
