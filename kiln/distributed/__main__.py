"""`python -m kiln.distributed ENGINE_DIR`: one rank (> 0) of an engine started by torchrun, Slurm or mpirun, when
rank 0 runs another program (e.g. `kiln serve ENGINE_DIR`); it serves rank 0's steps until rank 0 stops."""
from __future__ import annotations

import argparse
import functools
import sys

import torch

from kiln.builder.engine import load_engine_rank
from kiln.config import ParallelConfig
from kiln.distributed import launched_rank, serve_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.distributed", description=__doc__)
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
