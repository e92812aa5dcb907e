"""Running one engine on several processes (one per rank) with torch.distributed: gloo on CPUs, NCCL on GPUs.

    rank 0 (the LLM process): scheduler + its own shard ──broadcast step──▶ ranks 1..N-1 (workers: their shards)
    each tensor-parallel group all-reduces inside the layers; pipeline stages pass hidden states to the next stage,
    one micro-batch at a time so the stages overlap; the last stage sends the logits to rank 0, which samples.

Ranks start in one of two ways, with the same engine directory:
  * `LLM` spawns ranks 1..N-1 on this host (`Workers`), rendezvous over a local TCP port;
  * `torchrun` / Slurm / mpirun start every rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment):
    rank 0 runs the user's program (`LLM(engine_dir)`); the others either run the same program, whose `LLM(...)`
    serves as a worker and exits when rank 0 shuts down, or `python -m kiln.distributed ENGINE_DIR`.
Steps travel over a gloo group even on GPUs (a pickled Step is host data; NCCL would cost a device sync).
"""
from __future__ import annotations

import datetime
import gc
import os
import socket
import traceback
from dataclasses import dataclass

import torch

from .comm import Comm, GroupComm, SymmetricMemoryComm

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


def split_step(step: Step, parts: int) -> list[tuple[Step, list[int]]]:
    """Micro-batches of whole sequences with about equal token counts, each with the positions in
    step.logit_rows its logits fill (block copies go with the first)."""
    starts, count = step.query_start_loc, len(step.seq_lens)
    parts = max(1, min(parts, count))
    bounds, total = [0], starts[-1]
    for k in range(1, parts):                       # cut where k/parts of the tokens are done, one sequence each
        cut = bounds[-1] + 1
        while cut < count - (parts - k) and starts[cut] < total * k / parts:
            cut += 1
        bounds.append(cut)
    bounds.append(count)
    batches = []
    for a, b in zip(bounds, bounds[1:]):
        t0, t1 = starts[a], starts[b]
        owned = [j for j, row in enumerate(step.logit_rows) if t0 <= row < t1]
        batches.append((Step(step.block_copies if a == 0 else [], step.input_ids[t0:t1], step.positions[t0:t1],
                             step.slot_mapping[t0:t1], [s - t0 for s in starts[a:b + 1]], step.seq_lens[a:b],
                             step.block_tables[a:b], max(starts[i + 1] - starts[i] for i in range(a, b)),
                             max(step.seq_lens[a:b]), [step.logit_rows[j] - t0 for j in owned]), owned))
    return batches


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

    def broadcast_step(self, step: Step | None) -> Step | None:
        return self.broadcast(step)

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


def check_runnable(engine, device: torch.device) -> None:
    """Fail before any process starts when the engine's parallel options cannot run on this device."""
    if engine.build_config.plugin_config.use_custom_all_reduce and device.type != "cuda":
        raise ValueError("the engine was built with use_custom_all_reduce, which needs CUDA GPUs of one host; "
                         "rebuild without it to run on the CPU")


def init_process_group(engine, device: torch.device, init_method: str, timeout_s: float) -> ParallelContext:
    """Join the engine's ranks (this process is engine.pretrained_config.mapping.rank)."""
    import torch.distributed as dist

    config, mapping = engine.pretrained_config, engine.pretrained_config.mapping
    check_runnable(engine, device)
    custom = engine.build_config.plugin_config.use_custom_all_reduce
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=mapping.rank, world_size=mapping.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return ParallelContext(mapping, device, getattr(torch, config.dtype) if custom else None)


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


def rank_device(device_type: str, rank: int) -> torch.device:
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def serve_steps(rank: int, world_size: int, init_method: str, load_rank, device_type: str, timeout_s: float) -> None:
    """A worker rank: load its shard, size its KV cache as rank 0 says, then run every step rank 0 broadcasts
    until told to stop."""
    from kiln.config import KvCacheConfig
    from kiln.runtime.engine_core import plan_kv_blocks
    from kiln.runtime.model_runner import ModelRunner

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    device = rank_device(device_type, rank)
    engine = load_rank(rank, device)
    mapping = engine.pretrained_config.mapping
    if mapping.world_size != world_size or mapping.rank != rank:
        raise ValueError(f"the engine has {mapping.world_size} ranks; rank {rank} of {world_size} processes asked")
    parallel = init_process_group(engine, device, init_method, timeout_s)
    try:
        kv_config = KvCacheConfig(**parallel.broadcast(None))
        runner = ModelRunner(engine, device, rank=rank, parallel=parallel)
        blocks, _ = plan_kv_blocks(engine, kv_config, device, runner.kv_bytes_per_token)
        runner.allocate_kv(parallel.min_over_ranks(blocks))
        runner.capture_graphs()
        with torch.inference_mode():
            while (step := parallel.broadcast_step(None)) is not STOP:
                runner.run_step(step)
    finally:
        parallel.close()


def worker_main(rank: int, world_size: int, init_method: str, load_rank, device_type: str, timeout_s: float,
                errors) -> None:
    """Entry point of a spawned worker: serve_steps, with any failure reported to rank 0 through `errors`."""
    try:
        serve_steps(rank, world_size, init_method, load_rank, device_type, timeout_s)
    except BaseException:  # noqa: BLE001 - rank 0 shows this to the user
        errors.put((rank, traceback.format_exc()))
        raise


class Workers:
    """The worker processes of one LLM on this host (ranks 1..world-1), and what they reported on failure."""

    def __init__(self, load_rank, world_size: int, device_type: str, timeout_s: float):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.errors = ctx.SimpleQueue()
        self.processes = [ctx.Process(target=worker_main, daemon=True, name=f"kiln-rank{rank}",
                                      args=(rank, world_size, self.init_method, load_rank, device_type, timeout_s,
                                            self.errors))
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
