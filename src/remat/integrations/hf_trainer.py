"""`prepare_trainer`: remat in a Hugging Face ``Trainer`` (or a subclass such as TRL's ``SFTTrainer``) in one call.

Called after the Trainer is built and before ``trainer.train()``, it applies a checkpointing policy (or the plan
`remat.plan_activation_checkpointing` makes for the Trainer's own step under ``policy="auto"``) to the Trainer's
model, switches the Trainer's own activation checkpointing off if it was on (never both), optionally trains with
remat's fused linear cross-entropy, and adds the step's peak memory to the Trainer's logs. Only public extension
points are used: the Trainer's ``model`` and ``args`` attributes, a ``TrainerCallback``, and the two methods the
Trainer's documentation says to override (``log``, and ``training_step`` under ``auto``), overridden on the instance
as a subclass would; the fused loss replaces the *model's* forward on its instance (remat's own wrapping mechanism,
as for checkpointing), so the Trainer's loss path, its ``num_items_in_batch`` normalisation over accumulation and
ranks included, is the Trainer's.
"""

from __future__ import annotations

import contextlib
import logging
import types
import typing
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback
from transformers.modeling_outputs import CausalLMOutputWithPast

from remat.checkpointing import CheckpointPlan, CheckpointPolicy, apply_activation_checkpointing, parse_policy
from remat.checkpointing.hf_native import disable_hf_checkpointing, is_hf_checkpointing
from remat.errors import ConfigError
from remat.loss.trl_head import TRLFusedLMHead, trl_forward, trl_head_options
from remat.loss import FusedLinearCrossEntropy, output_head, verify_output_head
from remat.memory import StepMemoryMeter
from remat.planner import ActivationPlan
from remat.adaptation.adapter import PlanAdapter
from remat.planner.api import planner_for_model
from remat.planner.spelling import TRAINER
from remat.recipes.build import compile_blocks, lora_section
from remat.recipes.config import CompileConfig
from remat.adaptation.trainer import FirstStepCheck, MicroBatchRetry, leaving_no_trace

logger = logging.getLogger(__name__)

LOSSES: tuple[str, ...] = ("keep", "fused")
#: The Trainer's ``optim`` values the estimate models: AdamW in torch's implementations (its keyword arguments).
OPTIMIZERS: dict[str, dict[str, Any]] = {"adamw_torch": {}, "adamw_torch_fused": {"fused": True}}
#: The log key of the step's peak memory (GiB), as the `| mem X GiB |` of remat's own step line.
MEMORY_LOG_KEY = "peak_mem_gib"


def prepare_trainer(trainer: Any, policy: Any = "selective", *, memory_budget: Any = None, loss: str = "keep",
                    seq_length: int | None = None, target: str | None = None,
                    log_memory: bool = True) -> CheckpointPlan | ActivationPlan:
    """Apply remat to ``trainer`` (a ``transformers.Trainer`` or subclass) before ``trainer.train()``; returns the plan
    (``print(plan.table())``).

    ``policy``: any policy `remat.apply_activation_checkpointing` takes (``"selective"``, ``"full"``,
    ``{"mode": "full", "every_n_layers": 2}``...) or ``"auto"``: the plan with the least recompute whose predicted
    peak fits ``memory_budget`` for the step this Trainer runs (micro-batch ``per_device_train_batch_size``,
    ``seq_length``, ``bf16``/``fp16`` autocast, ``gradient_accumulation_steps``, the loss; a budget is required on
    the CPU). ``loss="fused"`` trains with `remat.loss.FusedLinearCrossEntropy` (the logits are never materialised;
    checked first to reproduce the model's own logits, `remat.loss.verify_output_head`); ``"keep"`` leaves the
    model's loss. ``log_memory`` adds each step's peak (the CUDA allocator's, or the tracker's on the CPU) to the
    Trainer's logs as ``peak_mem_gib``. Under ``auto`` an out-of-memory error in a step's first micro-batch is
    re-planned and the micro-batch retried (docs/trainers.md, "Out of memory in a step"). A second call on the same
    Trainer is refused.
    """
    model = _trainer_model(trainer)
    _refuse_unpreparable(trainer, loss)
    base = _base_model(model)
    # Everything that can be refused is refused before the Trainer or its model is changed.
    planned: ActivationPlan | None = None
    adapter: PlanAdapter | None = None
    with leaving_no_trace(base):
        if isinstance(policy, str) and policy.strip().lower() == "auto":
            planned, adapter = _plan_for(trainer, base, memory_budget=memory_budget, loss=loss,
                                         seq_length=seq_length, target=target)
        elif memory_budget is not None:
            raise ConfigError(f"memory_budget: given with policy {policy!r}; a budget is planned for with "
                              "policy='auto' only")
        else:
            parse_policy(policy, key="policy")
        if loss == "fused":
            verify_output_head(base)
    _hf_checkpointing_off(trainer, model)
    if loss == "fused":
        use_fused_loss(base)
    applied = apply_activation_checkpointing(model, planned if planned is not None else policy)
    plan: CheckpointPlan | ActivationPlan = planned if planned is not None else applied
    compiled = _compile_blocks(trainer, model, applied.policy)
    _install(trainer, model, plan, adapter, log_memory=log_memory, compiled=compiled)
    return plan


def _install(trainer: Any, model: nn.Module, plan: CheckpointPlan | ActivationPlan, adapter: PlanAdapter | None, *,
             log_memory: bool, compiled: bool) -> None:
    """The callback (the plan's line, the step's peak in the logs, the first-step check of ``auto``) and, under
    ``auto``, the retry of a micro-batch that ran out of memory. Compiled blocks run eagerly under the exact
    tracker's dispatch mode: on the CPU their step is read as RSS, which is no figure to hold a plan against."""
    source = "rss" if compiled and trainer.args.device.type == "cpu" else "auto"
    check = FirstStepCheck(model, adapter) if adapter is not None and source == "auto" else None
    callback = RematCallback(plan, log_memory=log_memory, first_step_check=check, memory_source=source)
    trainer.add_callback(callback)
    if log_memory:
        _log_with_memory(trainer, callback)
    if adapter is not None:
        MicroBatchRetry(trainer, model, adapter).install()


def _compile_blocks(trainer: Any, model: nn.Module, policy: CheckpointPolicy) -> bool:
    """``TrainingArguments.torch_compile``: each decoder block compiled after remat wrapped it, instead of the
    Trainer's whole model; whether blocks were compiled.

    # NOTE [ The Trainer's torch_compile compiles blocks ]
    # With ``torch_compile`` the Trainer has accelerate compile the whole model when training starts, around remat's
    # wrapped blocks. remat compiles each decoder block after wrapping it instead, as its recipes' ``compile``
    # section does and as TorchTitan does: the compiled region is the block with its checkpoint, the blocks share one
    # compiled graph, and the loss and the optimizer stay eager. accelerate's dynamo plugin (the Trainer's
    # ``accelerator.state.dynamo_plugin``, public) is set to ``no`` so that the model is not compiled a second time;
    # ``torch_compile_backend`` and ``torch_compile_mode`` are the blocks'. One line says so.
    """
    args = trainer.args
    if not getattr(args, "torch_compile", False):
        return False
    from accelerate.utils import DynamoBackend

    backend = args.torch_compile_backend or "inductor"
    count = compile_blocks(model, policy, backend=backend, mode=args.torch_compile_mode)
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None:
        accelerator.state.dynamo_plugin.backend = DynamoBackend.NO
    logger.warning("prepare_trainer: TrainingArguments.torch_compile: remat compiled each of the %d decoder blocks "
                   "after wrapping it (backend %s), and the Trainer does not compile the whole model", count, backend)
    return True


def _compile_section(args: Any) -> dict[str, Any] | None:
    """The recipe ``compile`` section of the blocks `_compile_blocks` compiles, for the planner (which simulates
    them compiled: `remat.estimate.compiled`), or None without ``torch_compile`` or with a backend a recipe cannot
    name (planned as eager blocks, which hold at least what compiled ones do)."""
    backend = args.torch_compile_backend or "inductor"
    if not getattr(args, "torch_compile", False) or backend not in typing.get_args(CompileConfig.model_fields[
            "backend"].annotation):
        return None
    return {"enabled": True, "backend": backend, "mode": args.torch_compile_mode}


def _refuse_unpreparable(trainer: Any, loss: str) -> None:
    """A ConfigError for a call `prepare_trainer` cannot honour whatever the policy: an unknown loss, a Trainer
    prepared or trained already, DeepSpeed."""
    if loss not in LOSSES:
        raise ConfigError(f"loss: got {loss!r}; allowed: {', '.join(LOSSES)}")
    if any(isinstance(c, RematCallback) for c in trainer.callback_handler.callbacks):
        raise ConfigError("prepare_trainer: this Trainer is already prepared; call it once per Trainer (its model "
                          "is checkpointed already)")
    if getattr(getattr(trainer, "state", None), "global_step", 0):
        raise ConfigError(f"prepare_trainer: this Trainer has trained {trainer.state.global_step} steps already; "
                          "allowed: prepare_trainer before the first trainer.train() (make a new Trainer to "
                          "continue a run from its checkpoint)")
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise ConfigError("prepare_trainer: DeepSpeed is not supported yet (its ZeRO stages own the parameters remat "
                          "would plan for); allowed: no DeepSpeed, DDP, or FSDP through accelerate")


def _log_with_memory(trainer: Any, callback: RematCallback) -> None:
    """``trainer.log`` with the step's peak added to the logs it is given.

    # NOTE [ Why ``log`` and not ``on_log`` ]
    # ``Trainer.log`` appends the logs to ``state.log_history`` before it calls the callbacks' ``on_log``, and the
    # reporting integrations (wandb, TensorBoard) are callbacks that run before one added later: a value added in
    # ``on_log`` would reach neither. ``log`` is the method the Trainer's documentation says to override to inject
    # custom behaviour; it is overridden here on this instance (as a subclass would), adding one key and calling the
    # Trainer's own.
    """
    original = trainer.log

    def log(self: Any, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if callback.peak_gib is not None and "loss" in logs:
            logs[MEMORY_LOG_KEY] = round(callback.peak_gib, 4)
        original(logs, *args, **kwargs)

    trainer.log = types.MethodType(log, trainer)


def use_fused_loss(model: nn.Module) -> None:
    """Make ``model`` (a transformers causal LM) compute its training loss with `FusedLinearCrossEntropy` from its
    decoder's last hidden states, never the logits: its forward is replaced on the instance. With ``labels`` in
    training it returns the loss (and no logits) with Hugging Face's semantics: labels shifted by one, -100
    ignored, the sum divided by ``num_items_in_batch`` when given (the Trainer's normalisation over accumulation and
    ranks) or by the label tokens; otherwise it runs the model's own forward."""
    verify_output_head(model)
    own = model.__dict__.get("forward")
    if own is not None and getattr(own, "__func__", None) is not type(model).forward:
        trl = trl_forward(model)  # TRL copies the class's name onto its own
        if trl is not None:
            where = Path(trl.__code__.co_filename)
            raise ConfigError(f"loss: TRL's trainer already replaced the forward of {type(model).__name__} with its "
                              f"own loss computation ({where.parent.name}/{where.name}); allowed with this trainer: "
                              "loss='keep' (never two losses)")
        raise ConfigError(f"loss: the forward of {type(model).__name__} is already replaced on the instance (another "
                          "fused loss, or a second call); allowed: loss='fused' once, on a model whose forward is "
                          "its class's")
    head = output_head(model)
    loss_fn = FusedLinearCrossEntropy(logit_softcap=head.logit_softcap)
    decoder = model.get_decoder()
    original = model.forward
    said: list[bool] = []  # the fallback below is said once

    def forward(self: nn.Module, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        extra = {k: v for k, v in kwargs.items() if v is not None and k not in ("use_cache", "return_dict")}
        if extra and labels is not None and self.training and not said:
            said.append(True)
            logger.warning("loss='fused': the model was called with %s, which the fused loss does not take; the "
                           "model's own loss runs for such calls (with its logits)", ", ".join(sorted(extra)))
        if labels is None or not self.training or extra:
            return original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            labels=labels, num_items_in_batch=num_items_in_batch, **kwargs)
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False).last_hidden_state
        head = output_head(self)  # read here: under FSDP the whole weight is gathered by now
        if head.hidden_scale != 1.0:
            hidden = hidden * head.hidden_scale
        value = loss_fn(hidden, head.weight, labels, bias=head.bias, num_label_tokens=num_items_in_batch)
        return CausalLMOutputWithPast(loss=value, logits=None)

    model.forward = types.MethodType(forward, model)  # type: ignore[method-assign]


class RematCallback(TrainerCallback):
    """Measures each step's peak memory (read by the Trainer's ``log``: `_log_with_memory`), says the plan once at
    the start, and holds ``auto``'s plan against the first step (`FirstStepCheck`)."""

    def __init__(self, plan: CheckpointPlan | ActivationPlan, *, log_memory: bool = True,
                 first_step_check: FirstStepCheck | None = None, memory_source: str = "auto") -> None:
        self.plan = plan
        self.log_memory = log_memory
        self.memory_source = memory_source
        self.first_step_check = first_step_check
        self.meter: StepMemoryMeter | None = None
        self._step = contextlib.ExitStack()
        self.peak_gib: float | None = None
        """The last step's peak memory in GiB (None before the first step ends)."""
        self._began_with_state = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            logger.info("remat: %s", self.plan.summary())
        if self.log_memory or self.first_step_check is not None:
            self.meter = StepMemoryMeter(self.memory_source)  # type: ignore[arg-type]

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                      **kwargs: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps torch's
        self._began_with_state = bool(getattr(inner, "state", None))
        if self.meter is not None:
            self._step.enter_context(self.meter.step(model=model, optimizer=inner))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.meter is not None:
            self._step.close()
            self.peak_gib = self.meter.last.peak_bytes / 2**30
            check = self.first_step_check
            if check is not None and not check.done and (self._began_with_state or state.global_step >= 2):
                check(state.global_step, self.meter.last.peak_bytes, args.world_size)
            if not self.log_memory and (check is None or check.done):
                self.meter = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._step.close()


def _trainer_model(trainer: Any) -> nn.Module:
    model = getattr(trainer, "model", None)
    if not isinstance(model, nn.Module) or not hasattr(trainer, "args") or not hasattr(trainer, "add_callback"):
        raise ConfigError(f"trainer: expected a transformers Trainer (or a subclass such as trl.SFTTrainer) with its "
                          f"model; got {type(trainer).__name__}")
    return model


def _base_model(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)  # peft: the transformers model under the adapters
    return get_base() if callable(get_base) else model


def _hf_checkpointing_off(trainer: Any, model: nn.Module) -> None:
    """The Trainer's own activation checkpointing off, said in one line: remat checkpoints the blocks instead."""
    args = trainer.args
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        with warnings.catch_warnings():  # gradient_checkpointing is a deprecated alias where both exist
            warnings.simplefilter("ignore", FutureWarning)
            on = name in vars(args) and getattr(args, name)
            if on:
                setattr(args, name, False)
        if on:
            logger.warning("prepare_trainer: TrainingArguments.%s switched off: remat checkpoints the blocks "
                           "instead (never both)", name)
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "fsdp_plugin", None)
    if plugin is not None and getattr(plugin, "activation_checkpointing", False):
        plugin.activation_checkpointing = False
        logger.warning("prepare_trainer: FSDP's activation_checkpointing (fsdp_config) switched off: remat "
                       "checkpoints the blocks instead (never both)")
    base = _base_model(model)
    if is_hf_checkpointing(base):
        disable_hf_checkpointing(base)
        logger.warning("prepare_trainer: the model's own activation checkpointing switched off: remat checkpoints "
                       "the blocks instead (never both)")


def _plan_for(trainer: Any, model: nn.Module, *, memory_budget: Any, loss: str, seq_length: int | None,
              target: str | None) -> tuple[ActivationPlan, PlanAdapter]:
    """The plan for the step the Trainer runs, its arguments read from ``trainer.args``, and the adapter that plans
    again with the same planner after an out-of-memory error (`remat.adaptation.trainer.MicroBatchRetry`)."""
    _check_plannable_step(trainer)
    args = trainer.args
    optim = str(getattr(args.optim, "value", args.optim))
    optimizer = OPTIMIZERS.get(optim)
    if optimizer is None:
        raise ConfigError(f"prepare_trainer: TrainingArguments.optim {optim!r} is not one the estimate models; "
                          f"allowed with policy='auto': {', '.join(OPTIMIZERS)} (or a fixed policy)")
    rows = _row_shape(trainer, seq_length)
    autocast = "bfloat16" if getattr(args, "bf16", False) else "float16" if getattr(args, "fp16", False) else None
    planner, budget = planner_for_model(
        model, memory_budget=memory_budget, target=target, spelling=TRAINER,
        peft=lora_section(trainer.model, caller="prepare_trainer"),
        **rows, autocast=autocast,
        grad_accumulation=args.gradient_accumulation_steps, **_parallel_step(trainer), **_loss_step(model, loss),
        optimizer="torch.optim.AdamW",
        optimizer_kwargs={"lr": args.learning_rate, "weight_decay": args.weight_decay, **optimizer},
        clip_grad_norm=args.max_grad_norm or None, compile=_compile_section(args))
    plan = planner.plan(budget)
    return plan, PlanAdapter(lambda: planner, budget_bytes=budget, policy=plan.policy)


def _loss_step(model: nn.Module, loss: str) -> dict[str, Any]:
    """The loss of the planned step: TRL's fused LM head where TRL's trainer installed it on the model (its own
    code, `TRLFusedLMHead`), else remat's fused loss or the model's plain cross-entropy."""
    options = trl_head_options(model)
    if options is not None:
        return {"loss": f"{TRLFusedLMHead.__module__}.{TRLFusedLMHead.__name__}", "loss_kwargs": options}
    return {"loss": "fused" if loss == "fused" else "plain"}


def _parallel_step(trainer: Any) -> dict[str, Any]:
    """The strategy and world size of the Trainer's step, for the planner: DDP over ``args.world_size`` processes
    when there are several; the Trainer's FSDP is refused under ``auto`` in one line (accelerate's FSDP is not the
    FSDP2 step the estimate simulates, and the Trainer runs FSDP on GPUs only, where it has not been measured)."""
    if getattr(trainer, "is_fsdp_enabled", False):
        raise ConfigError("prepare_trainer: policy='auto' does not plan the Trainer's FSDP yet (accelerate's FSDP "
                          "casts and flattens parameters its own way, and the estimate has not been measured "
                          "against it); allowed with FSDP: a fixed policy such as 'selective' or 'full'; 'auto' "
                          "plans one process or DDP")
    world_size = int(getattr(trainer.args, "world_size", 1) or 1)
    return {"strategy": "ddp", "world_size": world_size} if world_size > 1 else {}


def _check_plannable_step(trainer: Any) -> None:
    """``auto`` plans the causal-LM step (one forward of the rows, the next-token loss) that ``Trainer`` and TRL's
    ``SFTTrainer`` run; a TRL trainer with another step (DPO's chosen and rejected rows and its reference model,
    GRPO's generations, ...) is refused in one line: a fixed policy works in it."""
    trl_classes = [cls.__name__ for cls in type(trainer).__mro__ if cls.__module__.split(".")[0] == "trl"]
    if trl_classes and "SFTTrainer" not in trl_classes:
        raise ConfigError(f"policy: 'auto' plans the causal-LM step of Trainer and TRL's SFTTrainer; "
                          f"{trl_classes[0]} runs another step (its own rows and models), which the planner does not "
                          "model; allowed with it: a fixed policy such as 'full' or 'selective'")
    if trl_classes and trl_head_options(_base_model(trainer.model)) is not None:
        # TRL's SFT step with its fused LM head is planned (TRLFusedLMHead); these options add a second forward.
        extra = ("compute_loss_func" if getattr(trainer, "compute_loss_func", None) is not None else
                 "label_smoothing_factor" if getattr(trainer, "label_smoother", None) is not None else None)
        if extra is not None:
            raise ConfigError(f"policy: 'auto' plans SFTTrainer's step with TRL's fused LM head; with {extra} TRL "
                              "runs the model's full logits and a second forward for its metrics, which the planner "
                              "does not model; allowed with it: a fixed policy such as 'full' or 'selective'")


def _row_shape(trainer: Any, seq_length: int | None) -> dict[str, int]:
    """The micro-batch the Trainer's collator makes, for the planner: ``per_device_train_batch_size`` rows of
    ``seq_length`` tokens (default: the train dataset's longest row, to which the collator pads a batch), or, where
    TRL's collator is padding-free (``padding_free``, or packing with the ``bfd`` strategies), those rows concatenated
    into one row of as many documents."""
    batch = int(trainer.args.per_device_train_batch_size)
    if seq_length is None:
        seq_length, where = _dataset_length(trainer)
    else:
        where = "seq_length="
    if getattr(trainer, "padding_free", False):
        logger.info("prepare_trainer: planning for one padding-free row of %d x %d tokens (%s; the collator "
                    "concatenates the micro-batch's rows)", batch, seq_length, where)
        return {"batch_size": 1, "seq_length": batch * seq_length, "documents_per_row": batch}
    logger.info("prepare_trainer: planning for rows of %d tokens (%s; pass seq_length= to plan for another length)",
                seq_length, where)
    return {"batch_size": batch, "seq_length": seq_length}


def _dataset_length(trainer: Any) -> tuple[int, str]:
    """The token length of the Trainer's longest row (a ``datasets.Dataset`` with ``input_ids``: read from its Arrow
    column without loading the rows) or of its first row (any other indexable dataset), and where it came from; else
    a ConfigError asking for ``seq_length=``."""
    dataset = getattr(trainer, "train_dataset", None)
    length, where = None, "the train dataset's first row"
    try:
        column = dataset.data.column("input_ids")  # type: ignore[union-attr]
        import pyarrow.compute as pc

        length, where = pc.max(pc.list_value_length(column)).as_py(), "the train dataset's longest row"
    except Exception:  # noqa: BLE001 (not an Arrow-backed datasets.Dataset with token rows)
        with contextlib.suppress(Exception):
            length = len(dataset[0]["input_ids"])  # type: ignore[index]
    if not length:
        raise ConfigError("seq_length: needed for policy='auto' (the planner plans for one row length), and the "
                          "Trainer's train_dataset gives none; allowed: prepare_trainer(..., seq_length=2048)")
    return int(length), where
