"""Backend selection and the kernel adapters, with fake cut_cross_entropy / liger_kernel modules (CPU only here)."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from loss_reference import reference_loss

from remat.errors import ConfigError
from remat.loss import FusedLinearCrossEntropy, backends
from remat.loss.backends import KernelRequest, select_backend

CUDA = torch.device("cuda")
CPU = torch.device("cpu")
BF16 = KernelRequest(torch.bfloat16, bias=False, softcap=None, hidden_needs_grad=True)


class FakeKernel:
    """Stands in for a kernel package's function: records its arguments, returns the float64 summed loss."""

    def __init__(self, returns_tuple: bool = False) -> None:
        self.calls: list[dict] = []
        self.returns_tuple = returns_tuple

    def __call__(self, hidden, weight, targets, **kwargs):
        self.calls.append({"hidden": hidden, "weight": weight, "targets": targets, **kwargs})
        logits = hidden.double() @ weight.double().T
        valid = targets != kwargs["ignore_index"]
        loss = torch.nn.functional.cross_entropy(logits[valid], targets[valid], reduction="sum")
        return (loss, None) if self.returns_tuple else loss


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch):
    """Install fake kernel packages by name ("cce", "liger"); returns their FakeKernels."""
    backends._announced.clear()

    def install(*names: str) -> dict[str, FakeKernel]:
        kernels = {}
        for name in names:
            module_name, function_name = backends.KERNELS[name]
            kernels[name] = FakeKernel(returns_tuple=name == "liger")
            module = types.ModuleType(module_name)
            setattr(module, function_name, kernels[name])
            monkeypatch.setitem(sys.modules, module_name, module)
        for name in set(backends.KERNELS) - set(names):  # make sure the others look absent
            monkeypatch.setitem(sys.modules, backends.KERNELS[name][0], None)
        return kernels

    backends._measured.clear()
    yield install
    backends._announced.clear()
    backends._measured.clear()


def test_torch_and_cpu_always_run_the_pure_pytorch_path(installed) -> None:
    installed("cce", "liger")
    assert select_backend("torch", CUDA) == "torch"
    assert select_backend("auto", CPU) == "torch"
    assert select_backend("cce", CPU) == "torch"


@pytest.mark.parametrize(("present", "expected"), [(("cce", "liger"), "cce"), (("liger",), "liger"), ((), "torch")])
def test_select_backend_auto_takes_the_first_usable_kernel(installed, present, expected) -> None:
    """(The fused loss itself decides "auto" by measurement: the tests below.)"""
    installed(*present)
    assert select_backend("auto", CUDA) == expected


def test_an_explicit_backend_that_is_absent_falls_back_with_one_warning(installed, caplog) -> None:
    installed("liger")
    with caplog.at_level(logging.INFO, logger="remat.loss"):
        assert select_backend("cce", CUDA) == "torch"
        assert select_backend("cce", CUDA) == "torch"
        assert select_backend("liger", CUDA) == "liger"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'cce' requested on cuda" in warnings[0].getMessage()
    assert any("backend 'liger' on cuda" in r.getMessage() for r in caplog.records)


def test_a_package_that_fails_to_import_counts_as_absent(installed, monkeypatch) -> None:
    installed()

    def broken_import(name: str):
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(backends.importlib, "import_module", broken_import)
    assert backends.load_kernel("cce") is None
    assert select_backend("auto", CUDA) == "torch"


@pytest.mark.parametrize("name", ["cce", "liger"])
def test_the_fused_loss_hands_shifted_targets_to_the_kernel_and_divides_its_sum(installed, monkeypatch, name):
    kernels = installed(name)
    monkeypatch.setattr("remat.loss.fused.select_backend", lambda requested, device, request: name)
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 6, 4), torch.randn(11, 4)
    labels = torch.randint(0, 11, (2, 6))
    labels[0, 2] = -100
    loss = FusedLinearCrossEntropy(logit_softcap=5.0, backend=name)(hidden, weight, labels, num_label_tokens=7)
    call = kernels[name].calls[-1]
    assert call["hidden"].shape == (12, 4) and call["weight"] is weight
    assert call["targets"].tolist() == torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1).reshape(-1).tolist()
    assert call["reduction"] == "sum" and call["softcap"] == 5.0 and call["ignore_index"] == -100
    assert call.get("filter_eps", "absent") == (None if name == "cce" else "absent")  # cce: exact gradients
    torch.testing.assert_close(loss.double(), reference_loss(hidden, weight, labels, reduction="sum") / 7)


@pytest.mark.parametrize(("request_", "why"), [
    (KernelRequest(torch.bfloat16, bias=True, softcap=None, hidden_needs_grad=True), "takes no bias"),
    (KernelRequest(torch.float32, bias=False, softcap=30.0, hidden_needs_grad=True), "backward needs bf16/fp16"),
])
def test_auto_skips_cce_where_it_cannot_do_the_call_and_says_why(installed, caplog, request_, why) -> None:
    installed("cce", "liger")
    with caplog.at_level(logging.INFO, logger="remat.loss"):
        assert select_backend("auto", CUDA, request_) == "liger"
    message = caplog.records[-1].getMessage()
    assert "backend 'liger' on cuda" in message and "skipped cce: " in message and why in message


def test_cce_without_a_backward_on_fp32_and_liger_with_a_bias_are_fine(installed) -> None:
    installed("cce", "liger")
    assert select_backend("auto", CUDA, KernelRequest(torch.float32, False, None, hidden_needs_grad=False)) == "cce"
    assert select_backend("liger", CUDA, KernelRequest(torch.bfloat16, True, 30.0, True)) == "liger"


def test_no_kernel_takes_float64_and_an_explicit_cce_with_bias_warns_and_runs_torch(installed, caplog) -> None:
    installed("cce", "liger")
    assert select_backend("auto", CUDA, KernelRequest(torch.float64, False, None, True)) == "torch"
    with caplog.at_level(logging.INFO, logger="remat.loss"):
        assert select_backend("cce", CUDA, KernelRequest(torch.bfloat16, True, None, True)) == "torch"
    assert caplog.records[-1].levelno == logging.WARNING
    assert "'cce' requested on cuda but cut-cross-entropy's linear_cross_entropy takes no bias" in (
        caplog.records[-1].getMessage())


def test_a_bias_reaches_liger_and_never_cce(installed, monkeypatch) -> None:
    kernels = installed("liger")
    monkeypatch.setattr("remat.loss.fused.select_backend", lambda requested, device, request: "liger")
    hidden, weight, bias = torch.randn(1, 5, 4), torch.randn(7, 4), torch.randn(7)
    FusedLinearCrossEntropy(backend="liger")(hidden, weight, torch.randint(0, 7, (1, 5)), bias=bias)
    assert kernels["liger"].calls[-1]["bias"] is bias
    with pytest.raises(ValueError, match="cut-cross-entropy takes no bias"):
        backends.kernel_arguments("cce", hidden[0], weight, torch.zeros(5, dtype=torch.long), bias, -100, None)


def test_unknown_backend_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"loss_fn.backend: got 'triton'; allowed: 'auto', 'torch', 'cce', 'liger'"):
        FusedLinearCrossEntropy(backend="triton")


@pytest.fixture
def kernels_on_the_cpu(installed, monkeypatch):
    """The fake kernels made usable on the CPU (the real ones are CUDA-only), each taking a given time, and remat's
    own path likewise: the measured choice then has a known answer. The time is a fake clock that only the delays
    advance (the calls' real compute time varies with the machine and torch build: a tie measured with sleeps was
    once lost by 2% on CI)."""
    clock = {"now": 0.0}
    monkeypatch.setattr(backends, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))

    def sleep(seconds: float) -> None:
        clock["now"] += seconds

    def install(delays: dict[str, float]) -> dict[str, FakeKernel]:
        kernels = installed(*(name for name in delays if name != "torch"))
        monkeypatch.setattr(backends, "_why_not", lambda name, device, request: (
            None if name in kernels else "not installed"))
        for name, kernel in kernels.items():
            original = kernel.__call__

            def slow(hidden, weight, targets, _original=original, _delay=delays[name], **kwargs):
                sleep(_delay)
                return _original(hidden, weight, targets, **kwargs)

            monkeypatch.setattr(kernel, "__call__", slow, raising=False)
            kernels[name] = _Slowed(kernel, slow)
        torch_loss = FusedLinearCrossEntropy._torch_loss

        def slow_torch(self, *args, **kwargs):
            sleep(delays.get("torch", 0.0))
            return torch_loss(self, *args, **kwargs)

        monkeypatch.setattr(FusedLinearCrossEntropy, "_torch_loss", slow_torch)
        for name, kernel in kernels.items():
            module_name, function_name = backends.KERNELS[name]
            monkeypatch.setattr(sys.modules[module_name], function_name, kernel)
        return kernels

    return install


class _Slowed:
    """A FakeKernel called through a slowed function (its calls still recorded)."""

    def __init__(self, kernel: FakeKernel, call) -> None:
        self.kernel, self.call = kernel, call

    @property
    def calls(self) -> list[dict]:
        return self.kernel.calls

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)


def _inputs(requires_grad: bool = True):
    torch.manual_seed(0)
    hidden = torch.randn(2, 6, 4, requires_grad=requires_grad)
    weight = torch.randn(11, 4, requires_grad=True)
    return hidden, weight, torch.randint(0, 11, (2, 6))


def test_auto_runs_the_fastest_measured_backend_once_per_shape_and_says_so(kernels_on_the_cpu, caplog) -> None:
    kernels = kernels_on_the_cpu({"cce": 0.03, "liger": 0.0, "torch": 0.01})
    hidden, weight, labels = _inputs()
    loss_fn = FusedLinearCrossEntropy()
    with caplog.at_level(logging.INFO, logger="remat.loss"):
        loss = loss_fn(hidden, weight, labels)
    timed = 1 + backends.TIMED_CALLS  # a warm-up and the timed calls
    assert len(kernels["cce"].calls) == timed and len(kernels["liger"].calls) == timed + 1  # + the real call
    torch.testing.assert_close(loss.double(), reference_loss(hidden, weight, labels))
    loss.backward()  # the timing's gradients went elsewhere: these are the real call's alone
    assert hidden.grad is not None and weight.grad is not None
    line = next(r.getMessage() for r in caplog.records if "fastest measured" in r.getMessage())
    assert line.startswith("FusedLinearCrossEntropy: backend 'liger' on cpu for device cpu, dtype float32, hidden 4, "
                           "vocab 11, bias False, softcap None, tokens up to 16, the fastest measured (liger ")
    assert "cce" in line and "torch" in line
    loss_fn(*_inputs())  # the same shape again: no more timing
    assert len(kernels["cce"].calls) == timed and len(kernels["liger"].calls) == timed + 2
    assert list(backends.measured_backends().values()) == ["liger"]


def test_remat_s_own_path_wins_a_tie(kernels_on_the_cpu) -> None:
    kernels = kernels_on_the_cpu({"liger": 0.02, "torch": 0.02})
    FusedLinearCrossEntropy()(*_inputs())
    assert len(kernels["liger"].calls) == 1 + backends.TIMED_CALLS  # timed, then not chosen
    assert list(backends.measured_backends().values()) == ["torch"]


def test_a_kernel_that_fails_its_timing_is_not_chosen(kernels_on_the_cpu, caplog) -> None:
    kernels = kernels_on_the_cpu({"liger": 0.0, "torch": 0.01})

    def broken(*args, **kwargs):
        raise RuntimeError("triton: out of resources")

    kernels["liger"].call = broken
    with caplog.at_level(logging.INFO, logger="remat.loss"):
        loss = FusedLinearCrossEntropy()(*_inputs())
    assert torch.isfinite(loss) and list(backends.measured_backends().values()) == ["torch"]
    assert any("backend 'liger' failed its timing on cpu (RuntimeError: triton: out of resources); not used"
               in r.getMessage() for r in caplog.records)


def test_a_call_without_gradients_is_not_timed_and_runs_remat_s_own_path(kernels_on_the_cpu) -> None:
    kernels = kernels_on_the_cpu({"liger": 0.0, "torch": 0.01})
    with torch.no_grad():
        FusedLinearCrossEntropy()(*_inputs(requires_grad=False))
    assert kernels["liger"].calls == [] and backends.measured_backends() == {}
