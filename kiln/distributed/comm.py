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

    def close(self) -> None:
        """Drop the process group (ParallelContext.close destroys it)."""


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

    def close(self) -> None:
        self.group = None


class SymmetricMemoryComm(GroupComm):
    """GroupComm whose small all-reduces (up to `max_bytes`) are one-shot kernels over symmetric memory: each rank
    copies its tensor into a buffer every peer can read, and one kernel sums the peers' copies (lower latency than
    NCCL's ring for the few KiB of a decode step; capturable in CUDA graphs). Larger ones go through NCCL."""

    def __init__(self, group, tp_size: int, tp_rank: int, dtype: torch.dtype, device: torch.device,
                 max_bytes: int = 1 << 19):
        import torch.distributed._symmetric_memory as symm_mem

        super().__init__(group, tp_size, tp_rank)
        self.group_name = group.group_name
        self.buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.buffer.dtype or x.numel() > self.buffer.numel():
            return super().all_reduce(x)
        staged = self.buffer[:x.numel()].view_as(x)
        staged.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, x)
