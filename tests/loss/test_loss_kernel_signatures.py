"""remat's calls of the real kernel packages match their installed signatures (CPU), and their results (CUDA).

Runs where the ``cuda-kernels`` extra is installed (both packages import on a CPU-only machine with Triton present);
skips with the reason where a package is absent. The CUDA test compares each kernel with the float64 reference.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect

import pytest
import torch
from loss_reference import reference_loss

from remat.loss import FusedLinearCrossEntropy, backends


def real_kernel(name: str):
    """The installed package's function for backend ``name``, or a skip naming what is missing."""
    module_name, function_name = backends.KERNELS[name]
    distribution = backends.DISTRIBUTIONS[name]
    if importlib.util.find_spec(module_name.split(".")[0]) is None:
        pytest.skip(f"{distribution} is not installed (pip install remat[cuda-kernels])")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - report the reason instead of failing on a broken optional install
        pytest.skip(f"{distribution} is installed but {module_name} does not import: {error}")
    return getattr(module, function_name)


def allowed_range(distribution: str) -> str:
    """The version range remat's ``cuda-kernels`` extra allows for ``distribution`` (from remat's metadata)."""
    from packaging.requirements import Requirement

    for text in importlib.metadata.requires("remat") or []:
        requirement = Requirement(text)
        if requirement.name == distribution and requirement.marker and requirement.marker.evaluate(
                {"extra": "cuda-kernels"}):
            return str(requirement.specifier)
    raise AssertionError(f"remat's cuda-kernels extra names no {distribution}")


@pytest.mark.parametrize("name", list(backends.KERNELS))
def test_installed_kernel_is_a_version_the_extra_allows(name: str) -> None:
    from packaging.specifiers import SpecifierSet

    real_kernel(name)
    distribution = backends.DISTRIBUTIONS[name]
    version = importlib.metadata.version(distribution)
    allowed = allowed_range(distribution)
    assert version in SpecifierSet(allowed), f"{distribution} {version} is outside the extra's range {allowed}"


@pytest.mark.parametrize("name", list(backends.KERNELS))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_every_call_binds_to_the_installed_signature(name: str, bias: bool, softcap: float | None) -> None:
    kernel = real_kernel(name)
    request = backends.KernelRequest(torch.bfloat16, bias=bias, softcap=softcap, hidden_needs_grad=True)
    if backends.kernel_refusal(name, request) is not None:
        pytest.skip(f"{name} is never called for this request ({backends.kernel_refusal(name, request)})")
    hidden, weight = torch.zeros(6, 4, dtype=torch.bfloat16), torch.zeros(9, 4, dtype=torch.bfloat16)
    targets = torch.tensor([1, 2, -100, 3, 4, -100])
    args, kwargs = backends.kernel_arguments(name, hidden, weight, targets, torch.zeros(9) if bias else None, -100,
                                             softcap)
    bound = inspect.signature(kernel).bind(*args, **kwargs)  # TypeError on any keyword the package does not take
    bound.apply_defaults()
    assert bound.arguments["reduction"] == "sum" and bound.arguments["ignore_index"] == -100
    assert bound.arguments["softcap"] == softcap
    if name == "liger":
        assert bound.arguments["bias"] is (kwargs["bias"]) and bound.arguments["return_z_loss"] is False
    else:
        assert bound.arguments["filter_eps"] is None and bound.arguments["shift"] is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the kernels are Triton GPU code)")
@pytest.mark.parametrize("name", list(backends.KERNELS))
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_kernel_backend_matches_the_float64_reference_on_cuda(name: str, softcap: float | None) -> None:
    real_kernel(name)
    backends._announced.clear()
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 64, 128, generator=generator).cuda().bfloat16().requires_grad_()
    weight = (torch.randn(1000, 128, generator=generator) / 128**0.5).cuda().bfloat16().requires_grad_()
    labels = torch.randint(0, 1000, (2, 64), generator=generator).cuda()
    labels[:, :10] = -100
    loss = FusedLinearCrossEntropy(logit_softcap=softcap, backend=name)(hidden, weight, labels)
    loss.backward()
    expected = reference_loss(hidden.detach().cpu(), weight.detach().cpu(), labels.cpu(), softcap=softcap)
    torch.testing.assert_close(loss.double().cpu(), expected, atol=2e-2, rtol=2e-2)
    reference_hidden = hidden.detach().cpu().double().requires_grad_()
    reference_weight = weight.detach().cpu().double().requires_grad_()
    reference_loss(reference_hidden, reference_weight, labels.cpu(), softcap=softcap).backward()
    for got, want in ((hidden.grad, reference_hidden.grad), (weight.grad, reference_weight.grad)):
        error = (got.double().cpu() - want).abs().max() / want.abs().max()
        assert error < 3e-2, f"{name}: gradient relative error {error:.3g}"
