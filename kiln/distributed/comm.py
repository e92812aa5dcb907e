"""Collectives inside one tensor-parallel group, as the model's layers need them (torch.distributed)."""
from __future__ import annotations

import torch


class Comm:
    """A single rank: every collective is the identity."""

    tp_size = 1
    tp_rank = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x


class GroupComm(Comm):
    """The tensor-parallel group of this rank (gloo on CPUs, NCCL on GPUs)."""

    def __init__(self, group, tp_size: int, tp_rank: int):
        self.group, self.tp_size, self.tp_rank = group, tp_size, tp_rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)
