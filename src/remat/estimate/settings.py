"""`StepSettings`: the flat keyword arguments of ``estimate_memory("llama-3.2-1b", batch_size=8, policy="full")``.

Not a second recipe schema: the estimate simulates a `remat.recipes.config.RecipeConfig`, and `StepSettings` is only
the convenience spelling of the recipe keys that matter for memory, turned into a recipe by `to_recipe` (validated by
the recipe's own validator) and derived back from one by `from_recipe` (for the report and ``--compare`` grids). It
is kept because these names are the estimate's public keyword arguments and its JSON rows' columns; four of its
fields are not recipe keys at all (``target``, ``world_size`` when the launcher decides it, ``documents_per_row``,
``vocab_size``: see `remat.estimate.run.SimulatedRun`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, get_args

from remat.checkpointing import CheckpointPolicy, parse_policy
from remat.distributed.choices import MIXED_PRECISION, STRATEGIES
from remat.errors import ConfigError
from remat.estimate.choices import LOSS_TARGETS, TARGETS, Target
from remat.estimate.run import SimulatedRun
from remat.models import ModelConfig
from remat.models.config import AutocastDtype, ParamDtype
from remat.recipes.config import RecipeConfig
from remat.recipes.loader import validate_recipe



@dataclass(frozen=True)
class StepSettings:
    """One training step to estimate: shapes, precision, memory savers, optimizer and parallelism.

    ``world_size`` is the number of processes, ``cp_size`` how many of them share each row (context parallelism)
    and ``tp_size`` how many split each block's weights (tensor parallelism, with FSDP2): ``world_size / (cp_size x
    tp_size)`` data-parallel ranks.
    ``batch_size`` is the per-rank micro-batch (``step_scheduler.local_batch_size``), ``grad_accumulation`` the
    micro-batches per step, ``policy`` ``distributed.activation_checkpointing``, ``loss`` ``"plain"`` / ``"fused"`` or
    a ``loss_fn._target_``; ``dtype``/``autocast`` None keep the model config's; ``peft`` the recipe's LoRA section
    (``{"r": 8, "target_modules": ["q_proj", "v_proj"]}``; None trains every parameter); ``compile`` the recipe's
    ``compile`` section (``{"enabled": True, "backend": "inductor"}``: blocks simulated compiled,
    `remat.estimate.compiled`; None: ``base``'s, else eager). ``base``: the recipe the other
    fields override (its remaining keys, e.g. ``distributed.fsdp_reduce_every_micro_batch``, are kept).
    """

    batch_size: int = 1
    seq_length: int = 2048
    dtype: str | None = None
    autocast: str | None = None
    policy: Any = "none"
    loss: str = "plain"
    loss_kwargs: Mapping[str, Any] = field(default_factory=dict)
    optimizer: str = "torch.optim.AdamW"
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=lambda: {"lr": 3e-4})
    clip_grad_norm: float | None = 1.0
    strategy: str = "single"
    world_size: int = 1
    cp_size: int = 1
    tp_size: int = 1
    mixed_precision: str | None = None
    grad_accumulation: int = 1
    documents_per_row: int = 1
    vocab_size: int | None = None
    target: Target = "cuda"
    custom_target_packages: tuple[str, ...] = ()
    peft: Mapping[str, Any] | None = None
    compile: Mapping[str, Any] | None = None
    base: RecipeConfig | None = field(default=None, compare=False, repr=False)

    def validate(self) -> None:
        """Raise `ConfigError` naming the keyword argument that is out of range (the recipe built from the settings
        is validated by the recipe's validator; this names the argument the caller typed)."""
        for name in ("batch_size", "seq_length", "world_size", "cp_size", "tp_size", "grad_accumulation",
                     "documents_per_row"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: got {value!r}; allowed: an integer >= 1")
        if self.seq_length < 2:
            raise ConfigError(f"seq_length: got {self.seq_length}; allowed: at least 2 (a token and its target)")
        _check_choice("target", self.target, TARGETS)
        _check_choice("strategy", self.strategy, STRATEGIES)
        if self.loss not in LOSS_TARGETS and "." not in self.loss:
            raise ConfigError(f"loss: got {self.loss!r}; allowed: {', '.join(LOSS_TARGETS)} or a loss_fn._target_")
        _check_choice("dtype", self.dtype, (*get_args(ParamDtype), None))
        _check_choice("autocast", self.autocast, (*get_args(AutocastDtype), None))
        _check_choice("mixed_precision", self.mixed_precision, (*MIXED_PRECISION, None))
        if self.strategy == "single" and self.world_size != 1:
            raise ConfigError(f"world_size: {self.world_size} needs strategy 'ddp' or 'fsdp2' (got 'single'); "
                              "allowed with 'single': 1")
        if self.world_size % self.cp_size:
            raise ConfigError(f"cp_size: {self.cp_size} does not divide world_size {self.world_size} (the processes, "
                              "dp x cp); allowed: a divisor of world_size")
        if self.tp_size > 1 and self.strategy != "fsdp2":
            raise ConfigError(f"tp_size: {self.tp_size} needs strategy 'fsdp2' (got {self.strategy!r}); allowed with "
                              f"{self.strategy!r}: 1")
        if self.world_size % (self.cp_size * self.tp_size):
            raise ConfigError(f"tp_size: cp_size {self.cp_size} x tp_size {self.tp_size} does not divide world_size "
                              f"{self.world_size} (the processes, dp x cp x tp); allowed: a tp_size whose product with "
                              "cp_size divides world_size")
        if self.mixed_precision is not None and self.strategy != "fsdp2":
            raise ConfigError(f"mixed_precision: {self.mixed_precision!r} is FSDP2's; allowed with strategy "
                              f"{self.strategy!r}: null (use autocast)")
        parse_policy(self.policy, key="policy")

    @property
    def data_parallel(self) -> int:
        """The data-parallel ranks: ``world_size / (cp_size x tp_size)``."""
        return self.world_size // (self.cp_size * self.tp_size)

    def describe(self) -> str:
        """A short label such as ``"full + fused"``."""
        return f"{parse_policy(self.policy, key='policy').describe()} + {self.loss}"

    def run(self) -> SimulatedRun:
        """What the simulation needs beyond the recipe."""
        return SimulatedRun(target=self.target, world_size=self.world_size,
                            documents_per_row=self.documents_per_row, vocab_size=self.vocab_size)

    def to_recipe(self, model: ModelConfig) -> RecipeConfig:
        """The recipe these settings describe for ``model`` (over ``base`` when given), validated as a recipe."""
        self.validate()
        data = self.base.model_dump(mode="json", by_alias=True) if self.base is not None else {}
        model_data = {k: v for k, v in model.model_dump(mode="json").items() if k != "output_hidden_states"}
        model_data.update({k: v for k, v in (("dtype", self.dtype), ("autocast", self.autocast)) if v is not None})
        policy = parse_policy(self.policy, key="policy")
        data.update({
            "model": model_data,
            "dataset": {**data.get("dataset", {}), "seq_length": self.seq_length},
            "step_scheduler": {**data.get("step_scheduler", {}), "local_batch_size": self.batch_size,
                               "global_batch_size": self.batch_size * self.data_parallel * self.grad_accumulation},
            "loss_fn": {"_target_": LOSS_TARGETS.get(self.loss, self.loss), **self.loss_kwargs},
            "optimizer": {"_target_": self.optimizer, **self.optimizer_kwargs},
            "clip_grad_norm": {"max_norm": self.clip_grad_norm},
            "distributed": {**data.get("distributed", {}), "strategy": self.strategy,
                            "activation_checkpointing": policy.to_dict(),
                            "dp_size": None if self.strategy == "single" else self.data_parallel,
                            "cp_size": self.cp_size, "tp_size": self.tp_size,
                            "mixed_precision": self.mixed_precision},
            "custom_target_packages": list(self.custom_target_packages),
            "peft": dict(self.peft) if self.peft is not None else None,
        })
        if self.compile is not None:
            data["compile"] = dict(self.compile)
        return validate_recipe(data)

    @classmethod
    def from_recipe(cls, cfg: RecipeConfig, *, vocab_size: int | None = None, **options: Any) -> StepSettings:
        """The settings of ``cfg`` (``options`` override them by name). A recipe for ``ddp`` / ``fsdp2`` without
        ``distributed.dp_size`` needs ``world_size`` (torchrun decides it at launch); 1 otherwise."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "base"]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ConfigError(f"{unknown[0]}: not a setting of the estimate; allowed: {', '.join(names)}")
        d, sched = cfg.distributed, cfg.step_scheduler
        cp_size = options.get("cp_size") or d.cp_size
        tp_size = options.get("tp_size") or d.tp_size
        world_size = options.pop("world_size", None) or (d.dp_size or 1) * cp_size * tp_size
        accumulation = sched.accumulation_steps(world_size // (cp_size * tp_size), world_size)
        short = {target: name for name, target in LOSS_TARGETS.items()}
        loss = short.get(cfg.loss_fn.target, cfg.loss_fn.target)
        settings = cls(
            batch_size=sched.local_batch_size, seq_length=cfg.dataset.seq_length, dtype=cfg.model.dtype,
            autocast=cfg.model.autocast, policy=_policy_value(d.policy if d.auto is None else d.auto.plan), loss=loss,
            loss_kwargs=dict(cfg.loss_fn.kwargs), optimizer=cfg.optimizer.target,
            optimizer_kwargs=dict(cfg.optimizer.kwargs), clip_grad_norm=cfg.clip_grad_norm.max_norm,
            strategy=d.strategy, world_size=world_size, cp_size=d.cp_size, tp_size=d.tp_size,
            mixed_precision=d.mixed_precision,
            grad_accumulation=accumulation, vocab_size=vocab_size,
            custom_target_packages=tuple(cfg.custom_target_packages),
            peft=cfg.peft.model_dump(mode="json") if cfg.peft is not None else None,
            compile=cfg.compile.model_dump(mode="json") if cfg.compile.enabled else None, base=cfg,
        )
        if "loss" in options and options["loss"] != loss:
            options.setdefault("loss_kwargs", {})  # the recipe's loss arguments belong to the recipe's loss
        if "optimizer" in options and options["optimizer"] != cfg.optimizer.target:
            lr = cfg.optimizer.kwargs.get("lr")
            options.setdefault("optimizer_kwargs", {"lr": lr} if lr is not None else {})  # likewise, but keep lr
        return dataclasses.replace(settings, **options)


def report_settings(recipe: RecipeConfig, run: SimulatedRun) -> StepSettings:
    """The settings an estimate of ``recipe`` on ``run`` reports (its JSON row's columns, its label): derived from
    the validated recipe, never turned back into one."""
    return StepSettings.from_recipe(recipe, vocab_size=run.vocab_size, world_size=run.world_size, target=run.target,
                                    documents_per_row=run.documents_per_row)


def _policy_value(policy: CheckpointPolicy | None) -> Any:
    """The shortest spelling of ``policy`` (``"full"`` rather than ``{"mode": "full"}``), for reports; ``none`` for
    an ``auto`` not planned yet (the planner prices every policy itself)."""
    if policy is None:
        return "none"
    spelled = policy.to_dict()
    return spelled["mode"] if list(spelled) == ["mode"] else spelled


def _check_choice(name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        shown = ", ".join("null" if a is None else str(a) for a in allowed)
        raise ConfigError(f"{name}: got {value!r}; allowed: {shown}")
