"""Process groups and collectives on torch.distributed (gloo on CPUs, NCCL on GPUs): what a rank needs to talk to
the others, and nothing about engines or steps (the worker loop that runs them is kiln.runtime.workers).

    rank 0 (the LLM process): scheduler + its own shard ──broadcast step──▶ ranks 1..N-1 (workers: their shards)
    each tensor-parallel group all-reduces inside the layers (comm.py); pipeline stages pass hidden states to the
    next stage, one micro-batch at a time so the stages overlap; the last stage sends the logits to rank 0.

Steps travel over a gloo group even on GPUs (a pickled step is host data; NCCL would cost a device sync).
"""
from __future__ import annotations

import datetime
import gc
import os
import socket
from collections.abc import Sequence

import torch

from .comm import Comm, GroupComm, SymmetricMemoryComm


class ParallelContext:
    """This process's place among the ranks, its tensor-parallel group and its pipeline neighbours."""

    def __init__(self, mapping, device: torch.device, custom_all_reduce_dtype: torch.dtype | None = None):
        """custom_all_reduce_dtype: the model's dtype when the engine asks for symmetric-memory all-reduces."""
        import torch.distributed as dist

        self.mapping, self.device, self.dist = mapping, device, dist
        tp, pp = mapping.tp_size, mapping.pp_size
        groups = [dist.new_group(ranks=[s * tp + t for t in range(tp)]) for s in range(pp)]
        self.comm: Comm = Comm()
        if tp > 1 and custom_all_reduce_dtype is not None:
            self.comm = SymmetricMemoryComm(groups[mapping.pp_rank], tp, mapping.tp_rank, custom_all_reduce_dtype,
                                            device)
        elif tp > 1:
            self.comm = GroupComm(groups[mapping.pp_rank], tp, mapping.tp_rank)
        self.control = dist.new_group(backend="gloo") if device.type == "cuda" else None   # steps, on the host
        self.last_stage_rank = (pp - 1) * tp                   # tp rank 0 of the last stage sends rank 0 the logits

    @property
    def rank(self) -> int:
        return self.mapping.rank

    def broadcast(self, value):
        """rank 0's value (any picklable object) on every rank."""
        box = [value]
        self.dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def send_hidden(self, hidden: torch.Tensor):
        """Start sending a stage's output to the same tensor-parallel rank of the next stage; returns the work."""
        hidden = hidden.contiguous()
        return hidden, self.dist.isend(hidden, dst=self.rank + self.mapping.tp_size)

    def recv_hidden(self, tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty((tokens, hidden_size), dtype=dtype, device=self.device)
        self.dist.recv(buffer, src=self.rank - self.mapping.tp_size)
        return buffer

    def send_logits(self, logits: torch.Tensor):
        if self.rank == self.last_stage_rank and self.rank != 0 and logits.shape[0]:
            logits = logits.contiguous()
            return logits, self.dist.isend(logits, dst=0)
        return None

    def recv_logits(self, rows: int, vocab: int) -> torch.Tensor:
        buffer = torch.empty((rows, vocab), dtype=torch.float32, device=self.device)
        if rows:
            self.dist.recv(buffer, src=self.last_stage_rank)
        return buffer

    def all_gather(self, value) -> list:
        """Every rank's value (any picklable object), in rank order, on every rank (over the host control group)."""
        values = [None] * self.mapping.world_size
        self.dist.all_gather_object(values, value, group=self.control)
        return values

    def all_true(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank (over the host control group: safe after a failed device call)."""
        t = torch.tensor([int(flag)], dtype=torch.int64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN, group=self.control)
        return bool(t.item())

    def close(self) -> None:
        """Destroy the process groups now, while the interpreter runs. Left to the interpreter's exit, a gloo thread
        still freeing the tensors of the last collective finds it finalizing and aborts the process ("terminate
        called without an active exception", a rank exiting -6 after its work was done)."""
        self.comm.close()                            # the layers share this object: their group goes too
        self.control = None
        if self.dist.is_initialized():
            self.dist.destroy_process_group()
        gc.collect()                                 # the groups' last references: their threads join here

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN)
        return int(t.item())


def init_process_group(mapping, device: torch.device, init_method: str, timeout_s: float,
                       custom_all_reduce_dtype: torch.dtype | None = None) -> ParallelContext:
    """Join the ranks of `mapping` as mapping.rank (NCCL on GPUs, gloo on CPUs)."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=mapping.rank, world_size=mapping.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return ParallelContext(mapping, device, custom_all_reduce_dtype)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_rank() -> tuple[int, int] | None:
    """(rank, world_size) when an external launcher (torchrun, Slurm, mpirun) started this process as one of
    several ranks; None otherwise."""
    rank = os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
    world = os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE"))
    if rank is None or world is None or int(world) <= 1:
        return None
    return int(rank), int(world)


def rank_device(device_type: str, rank: int, devices: Sequence[int] = ()) -> torch.device:
    """The device of `rank` on this host: cuda:devices[local rank] when devices are given (ParallelConfig.devices),
    else the local rank's GPU; the CPU for device_type "cpu"."""
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        index = devices[local] if devices else local % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")
