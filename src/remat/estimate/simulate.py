"""Simulate one training step on fake tensors and record every allocation it makes.

`simulate_step` builds the model under ``FakeTensorMode`` (shapes and dtypes, no storage), applies the recipe's
activation checkpointing and data-parallel wrapper through `remat.distributed.DistributedSetup` (over a fake process
group for ``ddp`` / ``fsdp2``), computes the loss with `remat.recipes.model_loss.CausalLMLoss` exactly as the
fine-tuning loop does, then runs backward, gradient clipping, the optimizer step (its state is created here) and
``zero_grad``, all inside a `LiveTensorTracker` whose listener records each allocation, free, resize and change of
category. The recorded `StepTrace` is what `remat.estimate.api` replays through an allocator model.

Details that make the fake step the real one:

- The batch (``input_ids``, ``labels``, ``position_ids``) is made of *real* integer tensors, and ops whose tensor
  arguments are all real run for real (`_SimulationMode`): the losses count label tokens and select rows by value,
  and transformers decides from the values of ``position_ids`` / ``attention_mask`` whether it must build a mask.
  Ops mixing real and fake tensors run fake. The batch's own bytes are counted (it lives on the device).
- ``target="cuda"`` models a CUDA GPU: attention runs the kernel CUDA would pick, with its backward workspaces
  (`remat.estimate.attention`; counts include recomputations), and optimizers that accept ``foreach`` get ``foreach=True`` unless the
  caller chose (PyTorch's default for CUDA parameters; on CPU parameters it runs a per-parameter loop).
  ``target="cpu"`` runs what the CPU runs, so the figures equal a real CPU step's tracked peak.
- DTensor's sharding propagation builds global-shape tensors to infer output shapes; on real tensors it does so in
  a private fake mode, which the simulation gives it here too, so those never count.
- ``ddp``: ``DistributedDataParallel`` needs real parameter data at construction, so it cannot wrap fake tensors.
  The step is simulated without the wrapper (every rank runs the whole model on its micro-batch, as in DDP), and the
  reducer's gradient buckets are added from the start of the step: DDP keeps one flat buffer per bucket (the first of
  1 MiB, the others of 25 MiB, filled in reverse parameter order as `dist._compute_bucket_assignment_by_size` does)
  for the whole run, next to the ``.grad`` tensors (``gradient_as_bucket_view=False``, the default).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from remat.checkpointing import parse_policy
from remat.errors import ConfigError
from remat.estimate.attention import CPU_ATTENTION_OP, CudaAttention, backward_workspace
from remat.memory.tracker import LiveTensorTracker
from remat.models import ModelConfig, build_model

Target = Literal["cuda", "cpu"]
TARGETS: Final[tuple[str, ...]] = ("cuda", "cpu")
Strategy = Literal["single", "ddp", "fsdp2"]
STRATEGIES: Final[tuple[str, ...]] = ("single", "ddp", "fsdp2")
LossKind = Literal["plain", "fused"]
LOSS_TARGETS: Final[dict[str, str]] = {
    "plain": "remat.loss.MaskedCrossEntropy",
    "fused": "remat.loss.FusedLinearCrossEntropy",
}
IGNORE_INDEX: Final[int] = -100
DDP_BUCKET_BYTES: Final[int] = 25 * 2**20
"""DistributedDataParallel's default bucket capacity (the first bucket is ``dist._DEFAULT_FIRST_BUCKET_BYTES``)."""
GRADIENT_BUCKETS: Final[str] = "gradient_buckets"
"""The category of DDP's gradient buckets, which the live-tensor tracker does not see."""


@dataclass(frozen=True)
class StepSettings:
    """One training step to simulate: shapes, precision, memory savers, optimizer and parallelism.

    ``batch_size`` is the per-rank micro-batch; ``grad_accumulation`` > 1 runs a second micro-batch while the first
    one's gradients are held (the third and later ones repeat the second). ``documents_per_row`` > 1 packs that many
    documents into each row (``position_ids`` restart), which makes transformers build a block-diagonal mask.
    ``dtype``/``autocast`` None keep the model config's. ``loss_kwargs`` and ``optimizer_kwargs`` are passed to the
    loss and optimizer like a recipe's. ``mixed_precision`` is FSDP2's parameter dtype for compute.
    """

    batch_size: int = 1
    seq_length: int = 2048
    dtype: str | None = None
    autocast: str | None = None
    policy: Any = "none"
    loss: LossKind = "plain"
    loss_kwargs: Mapping[str, Any] = field(default_factory=dict)
    optimizer: str = "torch.optim.AdamW"
    optimizer_kwargs: Mapping[str, Any] = field(default_factory=lambda: {"lr": 3e-4})
    clip_grad_norm: float | None = 1.0
    strategy: Strategy = "single"
    world_size: int = 1
    mixed_precision: str | None = None
    grad_accumulation: int = 1
    documents_per_row: int = 1
    vocab_size: int | None = None
    target: Target = "cuda"
    custom_target_packages: tuple[str, ...] = ()

    def validate(self) -> None:
        """Raise `ConfigError` naming the first setting that is out of range or an unsupported combination."""
        for name in ("batch_size", "seq_length", "world_size", "grad_accumulation", "documents_per_row"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: got {value!r}; allowed: an integer >= 1")
        if self.seq_length < 2:
            raise ConfigError(f"seq_length: got {self.seq_length}; allowed: at least 2 (a token and its target)")
        _check_choice("target", self.target, TARGETS)
        _check_choice("strategy", self.strategy, STRATEGIES)
        _check_choice("loss", self.loss, tuple(LOSS_TARGETS))
        _check_choice("dtype", self.dtype, ("float32", "bfloat16", "float16", None))
        _check_choice("autocast", self.autocast, ("bfloat16", "float16", None))
        _check_choice("mixed_precision", self.mixed_precision, ("bfloat16", "float16", "float32", None))
        if self.strategy == "single" and self.world_size != 1:
            raise ConfigError(f"world_size: {self.world_size} needs strategy 'ddp' or 'fsdp2' (got 'single'); "
                              "allowed with 'single': 1")
        if self.mixed_precision is not None and self.strategy != "fsdp2":
            raise ConfigError(f"mixed_precision: {self.mixed_precision!r} is FSDP2's; allowed with strategy "
                              f"{self.strategy!r}: null (use autocast)")
        if self.documents_per_row > self.seq_length // 2:
            raise ConfigError(f"documents_per_row: {self.documents_per_row} documents do not fit a row of "
                              f"{self.seq_length} tokens; allowed: 1 to {self.seq_length // 2}")
        policy = parse_policy(self.policy, key="policy")
        if policy.offload or any(o.offload or o.mode == "offload" for o in policy.layers) or policy.mode == "offload":
            raise ConfigError(f"policy: {policy.describe()!r} offloads activations to host memory, which the "
                              "estimate does not model; allowed: none, full, selective, attention, mlp, sqrt (with "
                              "every_n_layers / segments / per-layer modes)")

    def describe(self) -> str:
        """A short label such as ``"full + fused"``."""
        return f"{parse_policy(self.policy, key='policy').describe()} + {self.loss}"


def _check_choice(name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        shown = ", ".join("null" if a is None else str(a) for a in allowed)
        raise ConfigError(f"{name}: got {value!r}; allowed: {shown}")


@dataclass(frozen=True)
class StorageEvent:
    """One change the tracker counted (see `remat.memory.tracker.StorageListener`)."""

    kind: str
    serial: int
    nbytes: int
    category: str


@dataclass
class StepTrace:
    """What one simulated step allocated, in order, with the phase marks between the events."""

    settings: StepSettings
    events: list[StorageEvent] = field(default_factory=list)
    marks: list[tuple[int, str]] = field(default_factory=list)
    """(number of events recorded before the mark, label)."""
    tracked_peak: int = 0
    tracked_breakdown: dict[str, int] = field(default_factory=dict)
    parameters: int = 0
    trainable_parameters: int = 0
    attention_kernels: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def listener(self, kind: str, serial: int, nbytes: int, category: str) -> None:
        """The tracker's listener: appends one event."""
        self.events.append(StorageEvent(kind, serial, nbytes, category))

    def mark(self, label: str) -> None:
        """Start phase ``label`` at the current event."""
        self.marks.append((len(self.events), label))


class _SimulationMode(TorchDispatchMode):
    """Entered above the live-tensor tracker: runs ops whose tensor arguments are all real (the integer batch and
    what is computed from it) for real, outside the fake mode, so that value-dependent code works (label counts, row
    selection, mask decisions); and, when modelling CUDA, allocates the attention backward kernels' workspaces
    around their ops so that the tracker counts them."""

    def __init__(self, cuda: bool) -> None:
        super().__init__()
        self.cuda = cuda
        self.cpu_attention_calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # DTensor: let it run its ops on local tensors, which come back here
        if _all_real(args, kwargs):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if not self.cuda:
            return func(*args, **kwargs)
        if func is CPU_ATTENTION_OP:
            self.cpu_attention_calls += 1
        workspace = backward_workspace(func, args)
        try:
            return func(*args, **kwargs)
        finally:
            del workspace


def _all_real(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True when the arguments hold at least one tensor and no fake one (lists of tensors included)."""
    found = False
    for arg in (*args, *kwargs.values()):
        for item in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(item, torch.Tensor):
                if isinstance(item, FakeTensor):
                    return False
                found = True
    return found


def simulate_step(model: ModelConfig, settings: StepSettings) -> StepTrace:
    """Run one training step of ``model`` with ``settings`` on fake tensors and return its allocation trace."""
    settings.validate()
    trace = StepTrace(settings)
    start = time.perf_counter()
    model_cfg = model_config_for(model, settings)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with _process_group(settings), _private_sharding_fake_mode():
        mesh = _mesh(settings)  # outside the fake mode: the mesh reads its rank tensor
        with fake:
            torch.manual_seed(0)
            net = build_model(model_cfg, vocab_size=settings.vocab_size)
            root, parts, plan = parallelize(net, settings, mesh=mesh)
        if plan is not None:
            trace.notes.append(f"activation checkpointing: {plan}")
        trace.parameters = sum(_local_numel(p) for p in root.parameters())
        trainable = [p for p in root.parameters() if p.requires_grad]
        trace.trainable_parameters = sum(_local_numel(p) for p in trainable)
        vocab = int(net.config.get_text_config().vocab_size)
        batch = make_batch(settings, vocab)
        if settings.strategy == "ddp":
            _add_ddp_buckets(trace, trainable)
        with fake:
            optimizer = build_optimizer(settings, trainable)
        attention = CudaAttention() if settings.target == "cuda" else contextlib.nullcontext()
        mode = _SimulationMode(cuda=settings.target == "cuda")
        hook = parts.register_forward_hook(lambda *_: trace.mark("loss"))
        tracker = LiveTensorTracker(module=root, optimizer=optimizer, listener=trace.listener)
        def mark(label: str) -> None:
            trace.mark(label)
            tracker.mark(label)

        try:
            with fake, attention, tracker, mode:
                training_step(root, optimizer, batch, settings, trainable, mark=mark,
                              micro_batches=min(settings.grad_accumulation, 2))
        except RuntimeError as err:
            if "Expected inputs of BF16 type" in str(err):  # torch._grouped_mm's shape function (MoE experts)
                raise ConfigError(f"dtype: {model_cfg.dtype!r} cannot be simulated for {model_cfg.describe()}: its "
                                  "experts run torch._grouped_mm, whose shape function (used on fake tensors) "
                                  "accepts bfloat16 inputs only; allowed: dtype bfloat16") from err
            raise
        finally:
            hook.remove()
    trace.tracked_peak = tracker.peak_bytes
    trace.tracked_breakdown = tracker.peak_breakdown
    if isinstance(attention, CudaAttention):
        trace.attention_kernels = {k: v for k, v in attention.kernels.items() if v}
    if mode.cpu_attention_calls:
        trace.notes.append(f"{mode.cpu_attention_calls} attention calls bypassed the CUDA kernel model (the model "
                           "calls SDPA under another name) and were simulated with the CPU kernel")
    trace.seconds = time.perf_counter() - start
    return trace


def training_step(
    root: Callable[..., torch.Tensor],
    optimizer: torch.optim.Optimizer,
    batch: Mapping[str, torch.Tensor],
    settings: StepSettings,
    params: list[nn.Parameter],
    *,
    mark: Callable[[str], None] = lambda label: None,
    micro_batches: int | None = None,
) -> None:
    """One step of the fine-tuning loop (`remat.recipes.finetune`): forward and backward of each micro-batch (the
    loss normalised by the step's label tokens), gradient clipping, the optimizer step and ``zero_grad``.

    The simulation runs it on fake tensors; `benchmarks/bench_estimate_cuda.py` runs it on a GPU. ``mark`` is called
    with each phase's name as it starts. ``micro_batches`` defaults to ``settings.grad_accumulation``.
    """
    device = batch["input_ids"].device.type
    autocast = (torch.autocast(device, dtype=getattr(torch, settings.autocast)) if settings.autocast
                else contextlib.nullcontext())
    count = settings.grad_accumulation if micro_batches is None else micro_batches
    for index in range(count):
        suffix = f" (micro-batch {index + 1})" if count > 1 else ""
        mark("forward" + suffix)
        on_device = {name: tensor.clone() for name, tensor in batch.items()}  # the batch lives on the device
        label_tokens = int((on_device["labels"][..., 1:] != IGNORE_INDEX).sum()) * settings.grad_accumulation
        with autocast:
            loss = root(on_device, num_label_tokens=label_tokens)
        mark("backward" + suffix)
        loss.backward()
        del loss, on_device
    mark("optimizer step")
    if settings.clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], settings.clip_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------------------------ building blocks

def model_config_for(model: ModelConfig, settings: StepSettings) -> ModelConfig:
    """``model`` with the settings' dtype and autocast, and the hidden-states output the fused loss needs."""
    update: dict[str, Any] = {"output_hidden_states": settings.loss == "fused"}
    if settings.dtype is not None:
        update["dtype"] = settings.dtype
    if settings.autocast is not None:
        update["autocast"] = settings.autocast
    return ModelConfig.model_validate({**model.model_dump(), **update})


def make_batch(settings: StepSettings, vocab_size: int) -> dict[str, torch.Tensor]:
    """The micro-batch the simulation trains on, as real integer tensors: random token ids, ``documents_per_row``
    documents per row (``position_ids`` restart at each), every token a target except each document's first."""
    generator = torch.Generator().manual_seed(0)
    shape = (settings.batch_size, settings.seq_length)
    input_ids = torch.randint(0, vocab_size, shape, generator=generator)
    document = -(-settings.seq_length // settings.documents_per_row)
    position_ids = (torch.arange(settings.seq_length) % document).expand(shape).clone()
    labels = input_ids.clone()
    labels[position_ids == 0] = IGNORE_INDEX  # a document's first token is never predicted from the one before
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def build_optimizer(settings: StepSettings, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The settings' optimizer over ``params`` (``foreach=True`` for the CUDA target, see the module docstring)."""
    from remat.recipes.targets import OPTIMIZER, build_target, resolve_target

    kwargs = dict(settings.optimizer_kwargs)
    if settings.target == "cuda" and not {"foreach", "fused"} & set(kwargs):
        import inspect

        optimizer_class = resolve_target(settings.optimizer, key="optimizer._target_", kind=OPTIMIZER,
                                         custom_packages=settings.custom_target_packages)
        if "foreach" in inspect.signature(optimizer_class).parameters:
            kwargs["foreach"] = True  # what PyTorch picks by default for CUDA parameters
    optimizer: torch.optim.Optimizer = build_target(settings.optimizer, kwargs, key="optimizer._target_",
                                                    kind=OPTIMIZER, custom_packages=settings.custom_target_packages,
                                                    params=params)
    return optimizer


def build_loss(settings: StepSettings) -> Callable[..., torch.Tensor]:
    """The settings' loss function, built like a recipe's ``loss_fn``."""
    from remat.recipes.targets import LOSS, build_target

    loss: Callable[..., torch.Tensor] = build_target(LOSS_TARGETS[settings.loss], dict(settings.loss_kwargs),
                                                     key="loss_fn._target_", kind=LOSS)
    return loss


def parallelize(net: nn.Module, settings: StepSettings, *, mesh: Any = None,
                device: torch.device | None = None) -> tuple[nn.Module, nn.Module, str | None]:
    """Wrap ``net`` and its loss as the recipe does (`DistributedSetup.parallelize`: checkpointing, then FSDP2 over
    ``mesh``; DDP is simulated without its wrapper). Returns (the module a step calls, the module whose forward ends
    right before the loss, a summary of the checkpointing plan or None)."""
    from remat.distributed import DistributedSetup
    from remat.recipes.model_loss import CausalLMLoss

    compute = CausalLMLoss(net, build_loss(settings), use_hidden_states=settings.loss == "fused")
    strategy = "single" if settings.strategy == "ddp" else settings.strategy  # see the module docstring
    setup = DistributedSetup(strategy=strategy, activation_checkpointing=settings.policy,
                             dp_size=settings.world_size, world_size=settings.world_size,
                             mixed_precision=settings.mixed_precision, device=device or torch.device("cpu"),
                             mesh=mesh)
    root = setup.parallelize(net, root=compute)  # the model is built on `device`: nothing is moved
    parts = compute.decoder if settings.loss == "fused" else net
    return root, parts, setup.plan.summary() if setup.plan is not None else None


def _add_ddp_buckets(trace: StepTrace, trainable: list[nn.Parameter]) -> None:
    """Record DDP's gradient buckets as allocations made before the step (serials below zero: the tracker's are
    positive)."""
    params = list(reversed(trainable))
    buckets, _ = dist._compute_bucket_assignment_by_size(
        params, [dist._DEFAULT_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES], [False] * len(params))
    sizes = [sum(params[i].numel() * params[i].element_size() for i in bucket) for bucket in buckets]
    for index, nbytes in enumerate(sizes):
        trace.events.insert(index, StorageEvent("alloc", -1 - index, nbytes, GRADIENT_BUCKETS))
    trace.notes.append(f"ddp: gradients are all-reduced through {len(sizes)} buckets ({sum(sizes) / 2**30:.2f} GiB) "
                       "held for the whole run")


def _mesh(settings: StepSettings) -> Any:
    if settings.strategy != "fsdp2":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (settings.world_size,), mesh_dim_names=("dp",))


def _local_numel(tensor: torch.Tensor) -> int:
    local = getattr(tensor, "_local_tensor", None)
    return int(local.numel() if local is not None else tensor.numel())


@contextlib.contextmanager
def _process_group(settings: StepSettings) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks (this process is rank 0) for FSDP2."""
    if settings.strategy != "fsdp2":
        yield
        return
    if dist.is_initialized():
        raise ConfigError(f"strategy: simulating {settings.strategy!r} needs its own (fake) process group, but this "
                          "process already joined one; run the estimate outside a distributed job")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=settings.world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _private_sharding_fake_mode() -> Iterator[None]:
    """DTensor infers output shapes by running ops on global-shape fake tensors, in the active fake mode if there is
    one. Give it a private fake mode, as on real tensors, so that the tracker never sees those shadow tensors."""
    from torch.distributed.tensor import _sharding_prop

    original = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args: None  # type: ignore[assignment]
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original  # type: ignore[assignment]
