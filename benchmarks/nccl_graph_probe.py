"""Probe (one GPU): can this torch capture NCCL collectives and the symmetric-memory one-shot all-reduce inside a
CUDA graph, as tensor-parallel decode graphs need? Runs a 1-rank NCCL group (the same ProcessGroupNCCL code path).

    python3 benchmarks/nccl_graph_probe.py
"""
from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kiln.distributed.comm import GroupComm, SymmetricMemoryComm  # noqa: E402


def captured(comm, x: torch.Tensor) -> bool:
    out = comm.all_reduce(x.clone())                # warm up outside the capture
    torch.cuda.synchronize()
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = comm.all_reduce(static)
    static.copy_(x * 2)
    graph.replay()
    torch.cuda.synchronize()
    return torch.allclose(result, x * 2 * comm.tp_size) and torch.allclose(out, x * comm.tp_size)


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(ranks=[0])
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    for name, make in (("nccl", lambda: GroupComm(group, 1, 0)),
                       ("symmetric_memory", lambda: SymmetricMemoryComm(group, 1, 0, torch.bfloat16, x.device))):
        try:
            print(f"{name}: captured and replayed correctly = {captured(make(), x)}", flush=True)
        except Exception as err:  # noqa: BLE001 - report every probe
            print(f"{name}: FAILED {type(err).__name__}: {str(err)[:500]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
