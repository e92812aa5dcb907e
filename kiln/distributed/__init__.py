"""Running one engine on several processes (one per rank) with torch.distributed: gloo on CPUs, NCCL on GPUs.

    rank 0 (the LLM process): scheduler + its own shard ──broadcast step──▶ ranks 1..N-1 (workers: their shards)
    each tensor-parallel group all-reduces inside the layers; pipeline stages pass hidden states to the next stage;
    the last stage gathers the logits and sends them to rank 0, which samples.

Workers are started by `launch_workers` (spawn) on one host; under torchrun every rank runs `worker_main`
(rank 0 through LLM) with the same engine directory.
"""
from __future__ import annotations

import datetime
import os
import socket
import traceback
from dataclasses import dataclass

import torch

from .comm import Comm, GroupComm

STOP = None


@dataclass
class Step:
    """Everything a rank needs to run one forward pass (plain lists: it is broadcast by pickling)."""

    block_copies: list
    input_ids: list
    positions: list
    slot_mapping: list
    query_start_loc: list
    seq_lens: list
    block_tables: list
    max_query_len: int
    max_seq_len: int
    logit_rows: list


class ParallelContext:
    """This process's place among the ranks, its tensor-parallel group and its pipeline neighbours."""

    def __init__(self, mapping, device: torch.device):
        import torch.distributed as dist

        self.mapping, self.device, self.dist = mapping, device, dist
        tp, pp = mapping.tp_size, mapping.pp_size
        groups = [dist.new_group(ranks=[s * tp + t for t in range(tp)]) for s in range(pp)]
        self.comm: Comm = GroupComm(groups[mapping.pp_rank], tp, mapping.tp_rank) if tp > 1 else Comm()
        self.last_stage_rank = (pp - 1) * tp                   # tp rank 0 of the last stage sends rank 0 the logits

    @property
    def rank(self) -> int:
        return self.mapping.rank

    def broadcast_step(self, step: Step | None) -> Step | None:
        box = [step]
        self.dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def send_hidden(self, hidden: torch.Tensor) -> None:
        self.dist.send(hidden.contiguous(), dst=self.rank + self.mapping.tp_size)

    def recv_hidden(self, tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty((tokens, hidden_size), dtype=dtype, device=self.device)
        self.dist.recv(buffer, src=self.rank - self.mapping.tp_size)
        return buffer

    def send_logits(self, logits: torch.Tensor) -> None:
        if self.rank == self.last_stage_rank and self.rank != 0:
            self.dist.send(logits.contiguous(), dst=0)

    def recv_logits(self, rows: int, vocab: int) -> torch.Tensor:
        buffer = torch.empty((rows, vocab), dtype=torch.float32, device=self.device)
        self.dist.recv(buffer, src=self.last_stage_rank)
        return buffer

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN)
        return int(t.item())


def init_process_group(mapping, device: torch.device, init_method: str, timeout_s: float) -> ParallelContext:
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=mapping.rank, world_size=mapping.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return ParallelContext(mapping, device)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device_type: str, rank: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def worker_main(rank: int, world_size: int, init_method: str, engine_dir: str, device_type: str, kv_config: dict,
                timeout_s: float, errors) -> None:
    """A worker rank: load its shard, then run every step rank 0 broadcasts until told to stop."""
    try:
        from kiln.builder import Engine
        from kiln.config import KvCacheConfig
        from kiln.runtime.engine_core import plan_kv_blocks
        from kiln.runtime.model_runner import ModelRunner

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        device = rank_device(device_type, rank)
        engine = Engine.from_dir(engine_dir, rank=rank, device=device)
        parallel = init_process_group(engine.pretrained_config.mapping, device, init_method, timeout_s)
        runner = ModelRunner(engine, device, rank=rank, parallel=parallel)
        blocks, _ = plan_kv_blocks(engine, KvCacheConfig(**kv_config), device, runner.kv_bytes_per_token)
        runner.allocate_kv(parallel.min_over_ranks(blocks))
        with torch.inference_mode():
            while (step := parallel.broadcast_step(None)) is not STOP:
                runner.run_step(step)
    except BaseException:  # noqa: BLE001 - rank 0 shows this to the user
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class Workers:
    """The worker processes of one LLM on this host (ranks 1..world-1), and what they reported on failure."""

    def __init__(self, engine_dir: str, world_size: int, device_type: str, kv_config: dict, timeout_s: float):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.errors = ctx.SimpleQueue()
        self.processes = [ctx.Process(target=worker_main, daemon=True, name=f"kiln-rank{rank}",
                                      args=(rank, world_size, self.init_method, engine_dir, device_type, kv_config,
                                            timeout_s, self.errors))
                          for rank in range(1, world_size)]
        for process in self.processes:
            process.start()

    def failure(self) -> str | None:
        """A description of the first worker that failed, if any did."""
        if not self.errors.empty():
            rank, trace = self.errors.get()
            return f"worker rank {rank} failed:\n{trace}"
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode not in (None, 0):
                return f"worker rank {rank} exited with code {process.exitcode}"
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        for process in self.processes:
            process.join(timeout_s)
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout_s)
