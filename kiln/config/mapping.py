"""Where a rank sits in the tensor × pipeline parallel grid."""
from __future__ import annotations

from dataclasses import dataclass

from .fields import require, require_positive


@dataclass
class Mapping:
    """The parallel layout of one model: `world_size = tp_size * pp_size` ranks, this one being `rank`."""

    world_size: int = 1
    """Number of ranks (processes, one GPU each) that run the model together."""
    rank: int = 0
    """This process's rank, 0 ≤ rank < world_size; rank = pp_rank * tp_size + tp_rank."""
    tp_size: int = 1
    """Tensor parallelism: each linear layer is split across this many ranks."""
    pp_size: int = 1
    """Pipeline parallelism: the layers are divided into this many consecutive stages."""

    def __post_init__(self):
        require_positive("Mapping", world_size=self.world_size, tp_size=self.tp_size, pp_size=self.pp_size)
        require(self.world_size == self.tp_size * self.pp_size,
                f"Mapping.world_size={self.world_size} must equal tp_size * pp_size = {self.tp_size * self.pp_size}")
        require(0 <= self.rank < self.world_size,
                f"Mapping.rank={self.rank} must be in [0, world_size={self.world_size})")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    def for_rank(self, rank: int) -> "Mapping":
        return Mapping(self.world_size, rank, self.tp_size, self.pp_size)
