"""The rules of a ``distributed`` section, without torch: between its keys (`check_strategy_rules`, run when a
`remat.distributed.config.DistributedConfig` is validated) and against the number of processes (`world_layout`: the
launcher runs it before any worker starts, `DistributedSetup.from_config` again in each process)."""

from __future__ import annotations

from typing import Any

from remat.errors import ConfigError


def check_strategy_rules(strategy: str, dp_size: int | None, tp_size: int, cp_size: int, mixed_precision: str | None,
                         cpu_offload: bool) -> None:
    """The rules between the keys of a ``distributed`` section that hold whatever the number of processes
    (`DistributedConfig` checks them when it is validated)."""
    if strategy == "single":
        for name, value in (("dp_size", dp_size or 1), ("tp_size", tp_size), ("cp_size", cp_size)):
            if value != 1:
                raise ConfigError(f"distributed.{name}: {value} needs strategy 'ddp' or 'fsdp2' (strategy 'single' "
                                  "runs one process)")
    if strategy != "fsdp2":
        for name, value, allowed in (("mixed_precision", mixed_precision, "null (use model.autocast)"),
                                     ("cpu_offload", cpu_offload, "false"), ("tp_size", tp_size, "1")):
            if value not in (None, False, 1):
                raise ConfigError(f"distributed.{name}: {value!r} needs strategy 'fsdp2' (got {strategy!r}); "
                                  f"allowed with {strategy!r}: {allowed}")



def world_layout(strategy: str, dp_size: int | None, tp_size: int, cp_size: int, *, world_size: int) -> int:
    """The data-parallel size of a ``distributed`` section whose keys are valid (`check_strategy_rules`) on
    ``world_size`` processes; `ConfigError` naming the key when the sizes do not fit that many."""
    if strategy == "single" and world_size != 1:
        raise ConfigError(
            f"distributed.strategy: 'single' runs one process, but the launch has {world_size} (WORLD_SIZE="
            f"{world_size}); allowed for several processes: 'ddp' or 'fsdp2'")
    dp = dp_size if dp_size is not None else max(world_size // (tp_size * cp_size), 1)
    if dp * tp_size * cp_size != world_size:
        raise ConfigError(
            f"distributed.dp_size x tp_size x cp_size = {dp} x {tp_size} x {cp_size} = {dp * tp_size * cp_size}, "
            f"but the launch has {world_size} process{'es' if world_size != 1 else ''} (WORLD_SIZE); allowed: "
            "sizes whose product is the number of processes (leave dp_size out to derive it)")
    return dp


def check_heads(heads: Any, cp_size: int, tp_size: int = 1) -> None:
    """`ConfigError` naming ``distributed.cp_size`` unless ``cp_size`` (x ``tp_size``) divides ``heads``."""
    if not isinstance(heads, int) or heads % (cp_size * tp_size) == 0:
        return
    if tp_size == 1:
        raise ConfigError(f"distributed.cp_size: {cp_size} must divide the model's attention heads ({heads}); "
                          f"allowed: a divisor of {heads}")
    raise ConfigError(f"distributed.cp_size: {cp_size} x tp_size {tp_size} must divide the model's attention heads "
                      f"({heads}: each tensor-parallel rank's {heads // tp_size if heads % tp_size == 0 else heads} "
                      "are split over the context-parallel ranks); allowed: a product that divides "
                      f"{heads}")
