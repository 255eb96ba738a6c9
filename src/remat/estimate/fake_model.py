"""The recipe's model built on fake tensors, LoRA adapters included.

`remat.recipes.build.build_recipe_model` builds the model and then applies the recipe's ``peft`` section
(`remat.recipes.build.apply_lora`). Under ``FakeTensorMode`` the second part fails: ``peft`` moves each new adapter
to its base layer's device and dtype with ``Module.to``, which on fake parameters swaps tensors, and fake tensors
made on a fresh op carry a weak reference (the fake mode's memo) that forbids the swap. So here the adapters are
made by the same `apply_lora` on the meta device (``peft`` leaves meta adapters where they are: their dtype is the
one the real build ends with, float32 unless the adapters were cast), and each meta parameter is then replaced by a
fake one of the same shape, dtype and ``requires_grad`` on the base model's device. Values do not matter on fake
tensors; what the step allocates does, and that is the same (asserted against a real CPU LoRA step in
tests/estimate/test_estimate_vs_real.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from remat._logs import quiet_log
from remat.recipes.build import apply_lora, build_recipe_model
from remat.recipes.config import RecipeConfig


def build_fake_model(recipe: RecipeConfig, fake: FakeTensorMode, *, vocab_size: int | None) -> nn.Module:
    """``recipe``'s model with fake parameters from ``fake``, with its LoRA adapters if any.

    No generator is seeded or drawn from: fake initialisers draw no numbers, and a seed set here would reach the run
    (torch.manual_seed also queues a CUDA seed applied when CUDA starts, replacing the run's own)."""
    with fake, quiet_log("remat.models.document_attention"), quiet_log("remat.models.fp8"):  # the real run's lines
        net = build_recipe_model(recipe.model_copy(update={"peft": None}), vocab_size=vocab_size, simulated=True)
    if recipe.peft is None:
        return net
    device = next(net.parameters()).device
    with torch.device("meta"):
        net = apply_lora(net, recipe.peft)
    with fake:
        for module in net.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and param.device.type == "meta":
                    module._parameters[name] = nn.Parameter(torch.empty_like(param, device=device),
                                                            requires_grad=param.requires_grad)
    return net
