"""ParallelConfig: how many ranks run a model, and how they split it (the seed's LLM ParallelConfig)."""
from __future__ import annotations

from dataclasses import dataclass

from .fields import require, require_positive


@dataclass
class ParallelConfig:
    """Tensor × pipeline parallelism of an LLM built from a model or checkpoint (an engine carries its own)."""

    tp_size: int = 1
    """Tensor-parallel ranks."""
    pp_size: int = 1
    """Pipeline stages."""
    auto_parallel: bool = False
    """Choose tp_size and pp_size for world_size ranks (kiln.distributed.auto.choose_parallelism)."""
    world_size: int = 1
    """With auto_parallel: the number of ranks to use."""
    max_memory_mb: int | None = None
    """With auto_parallel: memory per rank for weights (None: the device's)."""
    timeout_s: float = 120.0
    """A collective that waits longer than this (a dead or hung rank) fails instead of hanging."""

    def __post_init__(self):
        require_positive("ParallelConfig", tp_size=self.tp_size, pp_size=self.pp_size, world_size=self.world_size,
                         timeout_s=self.timeout_s, max_memory_mb=self.max_memory_mb)
        require(not self.auto_parallel or (self.tp_size == 1 and self.pp_size == 1),
                "ParallelConfig: give either auto_parallel with world_size, or tp_size/pp_size")
