"""ParallelConfig: how many ranks run a model, and how they split it (the seed's LLM ParallelConfig)."""
from __future__ import annotations

from dataclasses import dataclass, field

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
    devices: list[int] = field(default_factory=list)
    """CUDA device index of each rank (rank i runs on cuda:devices[i]); empty: ranks 0..N-1 on GPUs 0..N-1."""

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
        self.devices = list(self.devices)
        require(all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in self.devices)
                and len(set(self.devices)) == len(self.devices),
                f"ParallelConfig: devices={self.devices} must be distinct CUDA device indices ≥ 0")
        require(not self.devices or len(self.devices) == self.ranks,
                f"ParallelConfig: devices={self.devices} names {len(self.devices)} GPUs for {self.ranks} ranks: give one "
                "device per rank, or none (ranks 0..N-1 on GPUs 0..N-1)")

    @property
    def ranks(self) -> int:
        """How many ranks run the model: world_size with auto_parallel, else tp_size × pp_size."""
        return self.world_size if self.auto_parallel else self.tp_size * self.pp_size

    def get_devices(self) -> list[int]:
        """The CUDA device index of each rank."""
        return self.devices if self.devices else list(range(self.ranks))
