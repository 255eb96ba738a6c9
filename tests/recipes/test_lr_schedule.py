from __future__ import annotations

import math

import pytest
import torch

from remat.recipes.config import LRSchedulerConfig
from remat.recipes.lr_schedule import build_lr_scheduler, lr_multiplier


def test_warmup_then_cosine_to_floor() -> None:
    cfg = LRSchedulerConfig(warmup_steps=4, decay="cosine", min_lr_ratio=0.1)
    values = [lr_multiplier(s, cfg, max_steps=14) for s in range(14)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert values[4] == pytest.approx(1.0)
    assert values[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_multiplier(14, cfg, max_steps=14) == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[3:], values[4:]))


def test_linear_and_constant() -> None:
    linear = LRSchedulerConfig(warmup_steps=0, decay="linear", min_lr_ratio=0.0)
    assert [lr_multiplier(s, linear, max_steps=4) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    constant = LRSchedulerConfig(warmup_steps=2, decay="constant")
    assert [lr_multiplier(s, constant, max_steps=4) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_scheduler_state_resumes_exactly() -> None:
    cfg = LRSchedulerConfig(warmup_steps=3, decay="cosine")
    params = [torch.nn.Parameter(torch.zeros(1))]
    opt = torch.optim.SGD(params, lr=1.0)
    sched = build_lr_scheduler(opt, cfg, max_steps=10)
    for _ in range(5):
        opt.step()
        sched.step()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = build_lr_scheduler(opt2, cfg, max_steps=10)
    opt2.load_state_dict(opt.state_dict())  # a resume restores both, optimizer first
    sched2.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    opt.step(); sched.step(); opt2.step(); sched2.step()  # noqa: E702
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
