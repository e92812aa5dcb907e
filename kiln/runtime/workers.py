"""Running one engine on several processes, one per rank: rank 0 (the LLM process) schedules and broadcasts each
`Step`; ranks 1..N-1 load their shards and replay the steps (`serve_steps`) until rank 0 broadcasts STOP.

Ranks start in one of two ways, with the same engine directory:
  * `LLM` spawns ranks 1..N-1 on this host (`Workers`), rendezvous over a local TCP port;
  * `torchrun` / Slurm / mpirun start every rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment):
    rank 0 runs the user's program (`LLM(engine_dir)`); the others either run the same program, whose `LLM(...)`
    serves as a worker and exits when rank 0 shuts down, or this module:

    python -m kiln.runtime.workers ENGINE_DIR      # one rank > 0, e.g. beside `kiln serve ENGINE_DIR` on rank 0
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import traceback

import torch

from kiln.builder.engine import load_engine_rank
from kiln.config import KvCacheConfig, LoraCacheConfig, ParallelConfig
from kiln.distributed import ParallelContext, free_port, init_process_group, launched_rank, rank_device

from .engine_core import plan_kv_blocks, refit_ranks
from .model_runner import ModelRunner
from .step import Refit

STOP = None     # what rank 0 broadcasts instead of a Step when it shuts down


def check_runnable(engine, device: torch.device) -> None:
    """Fail before any process starts when the engine's parallel options cannot run on this device."""
    if engine.build_config.plugin_config.use_custom_all_reduce and device.type != "cuda":
        raise ValueError("the engine was built with use_custom_all_reduce, which needs CUDA GPUs of one host; "
                         "rebuild without it to run on the CPU")


def join_ranks(engine, device: torch.device, init_method: str, timeout_s: float) -> ParallelContext:
    """Join the engine's ranks (this process is engine.pretrained_config.mapping.rank)."""
    config = engine.pretrained_config
    check_runnable(engine, device)
    custom = engine.build_config.plugin_config.use_custom_all_reduce
    return init_process_group(config.mapping, device, init_method, timeout_s,
                              getattr(torch, config.dtype) if custom else None)


def serve_steps(rank: int, world_size: int, init_method: str, load_rank, device_type: str, timeout_s: float,
                devices: tuple[int, ...] = ()) -> None:
    """A worker rank: load its shard, size its KV cache as rank 0 says, then run every step rank 0 broadcasts
    until told to stop."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    device = rank_device(device_type, rank, devices)
    engine = load_rank(rank, device)
    mapping = engine.pretrained_config.mapping
    if mapping.world_size != world_size or mapping.rank != rank:
        raise ValueError(f"the engine has {mapping.world_size} ranks; rank {rank} of {world_size} processes asked")
    parallel = join_ranks(engine, device, init_method, timeout_s)
    try:
        settings = parallel.broadcast(None)
        kv_config = KvCacheConfig(**settings["kv_cache"])
        runner = ModelRunner(engine, device, rank=rank, parallel=parallel,
                             lora_cache=LoraCacheConfig(**settings["lora_cache"]))
        blocks, _ = plan_kv_blocks(engine, kv_config, device, runner.kv_bytes_per_token)
        runner.allocate_kv(parallel.min_over_ranks(blocks))
        runner.capture_graphs()
        with torch.inference_mode():
            while (step := parallel.broadcast(None)) is not STOP:
                if isinstance(step, Refit):
                    refit_ranks(engine, runner, _opened(engine, step.source), parallel)
                    continue
                for slot, lora in step.lora_loads:      # the adapters rank 0 put into slots for this step
                    runner.lora.install(slot, lora)
                runner.run_step(step)
    finally:
        parallel.close()


def _opened(engine, source: str):
    """This rank's share of a refit source, or the error opening it (refit_ranks tells rank 0)."""
    try:
        return engine.refit_source(source)
    except Exception as err:  # noqa: BLE001 - rank 0 raises it
        return err


def worker_main(rank: int, world_size: int, init_method: str, load_rank, device_type: str, timeout_s: float,
                errors, devices: tuple[int, ...] = ()) -> None:
    """Entry point of a spawned worker: serve_steps, with any failure reported to rank 0 through `errors`."""
    try:
        serve_steps(rank, world_size, init_method, load_rank, device_type, timeout_s, devices)
    except BaseException:  # noqa: BLE001 - rank 0 shows this to the user
        errors.put((rank, traceback.format_exc()))
        raise


class Workers:
    """The worker processes of one LLM on this host (ranks 1..world-1), and what they reported on failure."""

    def __init__(self, load_rank, world_size: int, device_type: str, timeout_s: float, devices: tuple[int, ...] = ()):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.errors = ctx.SimpleQueue()
        self.processes = [ctx.Process(target=worker_main, daemon=True, name=f"kiln-rank{rank}",
                                      args=(rank, world_size, self.init_method, load_rank, device_type, timeout_s,
                                            self.errors, devices))
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


def main(argv: list[str] | None = None) -> int:
    """`python -m kiln.runtime.workers ENGINE_DIR`: one rank (> 0) of an engine started by torchrun, Slurm or
    mpirun, when rank 0 runs another program (e.g. `kiln serve ENGINE_DIR`); it serves rank 0's steps until rank 0
    stops."""
    parser = argparse.ArgumentParser(prog="python -m kiln.runtime.workers", description=main.__doc__)
    parser.add_argument("engine_dir", help="the engine directory (the same on every rank)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--timeout_s", type=float, default=ParallelConfig().timeout_s,
                        help="seconds a collective may wait before the rank gives up")
    args = parser.parse_args(argv)
    launched = launched_rank()
    if launched is None or launched[0] == 0:
        print("error: start this under torchrun/Slurm/mpirun as a rank > 0 (RANK and WORLD_SIZE set); rank 0 runs "
              "LLM or kiln serve on the same engine", file=sys.stderr)
        return 2
    serve_steps(*launched, "env://", functools.partial(load_engine_rank, args.engine_dir), args.device, args.timeout_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
