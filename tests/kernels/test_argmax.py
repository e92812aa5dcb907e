"""Greedy decoding's argmax in two small kernels (kernels/triton/argmax.py) against torch.argmax: under Triton's
interpreter on the CPU (marker `interpreter`: in the process tests/kernels/test_interpreter.py starts) and compiled on
the GPU (`pytest -m gpu`, skipped without one)."""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, interpreted, on_gpu


@pytest.mark.parametrize("backend", [interpreted(), on_gpu()])
def test_argmax_rows_is_torchs(backend):
    """Equal to torch.argmax: a vocabulary that is not a whole number of chunks, the maximum in the short last chunk,
    ties across and within chunks (the first wins), all -inf, NaN; on the GPU also 1-64 bf16 rows of the 8B
    vocabulary (128256 columns, the kernel's own chunks)."""
    from kiln.kernels.triton.argmax import argmax_rows

    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, 300, generator=g)
    x[1, 299] = 10.0                                   # in the last, short chunk
    x[2, [70, 5, 200]] = 7.0                           # a tie across chunks: column 5
    x[3, [130, 129]] = 7.0                             # a tie within a chunk: column 129
    x[4] = float("-inf")
    x[5, 150] = float("nan")
    x = x.to(DEVICE[backend])
    for rows in (x, x.bfloat16(), x[:, :256]):
        assert torch.equal(argmax_rows(rows.contiguous(), chunk=64), rows.argmax(dim=-1))
    if backend == "cuda":
        g = torch.Generator(device="cuda").manual_seed(3)
        for rows in (1, 2, 7, 64):
            x = torch.randn((rows, 128256), generator=g, device="cuda").bfloat16()
            x[0, [128255, 77, 90000]] = 100.0
            assert torch.equal(argmax_rows(x), x.argmax(dim=-1)), rows
