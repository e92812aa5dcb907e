"""ParallelConfig: how many ranks run a model, and how they split it (the seed's LLM ParallelConfig)."""
from __future__ import annotations

from dataclasses import dataclass

from .fields import require, require_positive


@dataclass
class ParallelConfig:
    """Tensor × pipeline parallelism of an LLM built from a model or checkpoint. A built engine carries its own:
    with one, the layout given here must be the engine's (or left at one rank), else LLM refuses it."""

    tp_size: int = 1
    """Tensor-parallel ranks."""
    pp_size: int = 1
    """Pipeline stages."""
    auto_parallel: bool = False
    """Choose tp_size and pp_size for world_size ranks (kiln.builder.auto_parallel.choose_parallelism)."""
    world_size: int = 1
    """With auto_parallel: the number of ranks to use. Without it, tp_size × pp_size is the world size: any other
    value than 1 or that product is refused."""
    max_memory_mb: int | None = None
    """With auto_parallel: memory per rank for weights (None: no limit); refused without auto_parallel."""
    timeout_s: float = 120.0
    """A collective that waits longer than this (a dead or hung rank) fails instead of hanging."""

    def __post_init__(self):
        require_positive("ParallelConfig", tp_size=self.tp_size, pp_size=self.pp_size, world_size=self.world_size,
                         timeout_s=self.timeout_s, max_memory_mb=self.max_memory_mb)
        require(not self.auto_parallel or (self.tp_size == 1 and self.pp_size == 1),
                "ParallelConfig: give either auto_parallel with world_size, or tp_size/pp_size")
        require(self.auto_parallel or self.world_size in (1, self.tp_size * self.pp_size),
                f"ParallelConfig: world_size={self.world_size} counts the ranks of auto_parallel; without it the "
                f"ranks are tp_size × pp_size = {self.tp_size * self.pp_size}: set auto_parallel=True or tp_size/pp_size")
        require(self.auto_parallel or self.max_memory_mb is None,
                "ParallelConfig: max_memory_mb limits the search of auto_parallel; set auto_parallel=True or leave it None")
