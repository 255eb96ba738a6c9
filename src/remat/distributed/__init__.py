"""Distributed setup: one process today; DDP and FSDP2 through torchrun next."""

from remat.distributed.setup import DistributedSetup

__all__ = ["DistributedSetup"]
