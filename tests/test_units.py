"""Sizes and counts as people read them (`remat.units`)."""

from __future__ import annotations

import pytest

from remat.units import format_bytes, format_flops


@pytest.mark.parametrize(("num", "text"), [
    (2**20, "1.00 MiB"), (62 * 2**20, "62.0 MiB"), (150 * 2**20, "150 MiB"), (120 * 2**20, "120 MiB"),
    (int(1.5 * 2**30), "1.50 GiB"), (int(31.71 * 2**30), "31.7 GiB"), (128 * 2**30, "128 GiB"),
    (25 * 2**40, "25.0 TiB"), (512, "512 B"),
])
def test_bytes_keep_three_significant_digits_in_a_unit_that_shows_them(num: int, text: str) -> None:
    assert format_bytes(num) == text


@pytest.mark.parametrize(("num", "text"), [(4.21e10, "42.1 GFLOP"), (3.2e12, "3.20 TFLOP"), (1.5e6, "1.50 MFLOP")])
def test_flops_below_a_tflop_are_gflop(num: float, text: str) -> None:
    assert format_flops(num) == text
