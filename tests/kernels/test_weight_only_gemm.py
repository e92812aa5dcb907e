"""kernels/triton/weight_only.py (weight-only W4A16/W8A16 products of more rows than the decode GEMV takes) against a
float64 product of the dequantized weight (kernels/quant.py): under Triton's interpreter on the CPU (marker
`interpreter`: in the process tests/kernels/test_interpreter.py starts) and compiled on real 8B shapes (`pytest -m
gpu`, the sweep `-m gpu_slow`; skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, interpreted, on_gpu
from kiln.kernels import quant

# algo, group (None: per channel)
FORMATS = [("W8A16", None), ("W4A16", None), ("W4A16_AWQ", None), ("W4A16", 64), ("W4A16_AWQ", 64),
           ("W4A16", 128), ("W4A16_AWQ", 128)]
GPU_FORMATS = [("W4A16_AWQ", 128), ("W4A16", 128), ("W8A16", None)]
GPU_SHAPES = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)]        # Llama-3.1-8B's
UNPACKS = ["GATHER", "PLANES", "RESHAPE", "RESHAPE_INNER"]


def _params(algo: str, w: torch.Tensor, group: int | None) -> dict:
    if algo == "W8A16":
        q, s = quant.quantize_int8(w)
        return {"weight": q, "weight_scale": s}
    packed, s, z = quant.quantize_int4(w, group, algo == "W4A16_AWQ")
    return {"weight": packed, "weight_scale": s, **({"weight_zero": z} if z is not None else {})}


def _case(algo: str, group: int | None, n: int, k: int, m: int, dtype, device="cpu", seed=0):
    """(x, params, bits, float64 reference product) for a random layer; x has a mean away from 0, as activations
    have (zero points then matter)."""
    g = torch.Generator(device=device).manual_seed(seed)
    params = _params(algo, torch.randn(n, k, generator=g, device=device), group)
    x = (torch.rand(m, k, generator=g, device=device) * 2 - 0.5).to(dtype)
    ref = x.double() @ quant.dequantize_weight(algo, params).double().T
    return x, params, 8 if algo == "W8A16" else 4, ref


def _layouts(params: dict, bits: int, engine: bool = True):
    """(interleaved, weight) for the engine layout (unless engine=False) and, where K allows it, the interleaved
    one."""
    from kiln.kernels.triton.gemv import block_columns, interleave_weight

    if engine:
        yield False, params["weight"]
    if (params["weight"].shape[1] * 8 // bits) % block_columns(bits) == 0:
        yield True, interleave_weight(params["weight"], bits)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape
    return ((out.double() - ref).norm() / ref.norm()).item()


# float32 x: the products are exact and the sums float32; fp16 x: the output's rounding (2^-11) dominates; bf16 x: the
# tiled kernel rounds only its output, dequantize + cuBLAS also the weight, to bf16
TOLERANCE = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
# backend: (rows of x with their dtype, the engine layout too, the functions computing the product)
PRODUCTS = {"interpreter": (((5, torch.float16), (17, torch.float32), (64, torch.float16), (300, torch.float16)), True,
                            ("tiled",)),
            "cuda": (tuple((m, torch.bfloat16) for m in (8, 64, 128, 512)), False, ("public", "tiled", "dequantized"))}


# the default GPU run: one 8B shape a format; the sweep: the others
SHARP = {"W4A16_AWQ": (4096, 14336), "W4A16": (6144, 4096), "W8A16": (28672, 4096)}


@pytest.mark.parametrize("backend, algo, group, n, k", [interpreted(algo, group, 80, 544) for algo, group in FORMATS]
                         + [on_gpu(algo, group, n, k, slow=(n, k) != SHARP[algo]) for algo, group in GPU_FORMATS
                            for n, k in GPU_SHAPES])
def test_weight_only_matmul_matches_the_reference(backend, algo, group, n, k):
    """Under the interpreter 544 columns: 4.25 groups of 128 and 8.5 of 64 (a short last group) and no whole number
    of 64- or 128-column steps; 80 rows: a partial tile of weight rows; 300 rows of x: several partial tiles of them.
    On the GPU the 8B shapes in bf16 through the public entry, the tiled kernel and dequantize + cuBLAS."""
    from kiln.kernels.triton import weight_only as wo

    functions = {"public": wo.weight_only_matmul, "tiled": wo.tiled_matmul, "dequantized": wo.dequantized_matmul}
    rows, engine, names = PRODUCTS[backend]
    for m, dtype in rows:
        x, params, bits, ref = _case(algo, group, n, k, m, dtype, device=DEVICE[backend], seed=m)
        for interleaved, weight in _layouts(params, bits, engine):
            for name in names:
                out = functions[name](x, weight, params["weight_scale"], params.get("weight_zero"), bits, interleaved)
                assert out.dtype == dtype and _rel(out, ref) < TOLERANCE[dtype], (m, interleaved, name, _rel(out, ref))


# backend: (weight rows, columns, rows of x, their dtype, split-K values, the tile)
VARIANTS = {"interpreter": (48, 544, (9,), torch.float32, (1, 3), dict(block_n=32, block_m=16, block_k=128)),
            "cuda": (1000, 2080, (5, 33, 300), torch.bfloat16, (1, 4), dict(block_n=64, block_m=32))}


@pytest.mark.parametrize("backend, algo, group, unpack",
                         [interpreted(algo, group, unpack) for algo, group in [("W8A16", None), ("W4A16_AWQ", 128),
                                                                               ("W4A16", None)] for unpack in UNPACKS]
                         + [on_gpu(algo, group, unpack, slow=(algo, unpack) not in (("W4A16_AWQ", "PLANES"),
                                                                                   ("W8A16", "RESHAPE")))
                            for algo, group in [("W4A16_AWQ", 64), ("W4A16", None), ("W8A16", None)]
                            for unpack in UNPACKS])
def test_unpacking_and_split_k_variants(backend, algo, group, unpack):
    """Each way of unpacking a tile's levels, split-K on and off, both layouts (configurations the tensor-core kernel
    does not take passed over), and dequantize + cuBLAS on the same weights; on the GPU 1000 × 2080: a short last
    group, no whole 128-column step, a partial tile of rows."""
    from kiln.kernels.triton import tuning, weight_only as wo

    n, k, rows, dtype, splits, tile = VARIANTS[backend]
    for m in rows:
        x, params, bits, ref = _case(algo, group, n, k, m, dtype, device=DEVICE[backend], seed=m)
        for interleaved, weight in _layouts(params, bits):
            for split in splits:
                config = tuning.MmaConfig(**tile, unpack=getattr(tuning, unpack), split=split)
                if not wo.mma_supported(bits, group or 0, interleaved, config):
                    continue
                out = wo.tiled_matmul(x, weight, params["weight_scale"], params.get("weight_zero"), bits, interleaved,
                                      config)
                assert _rel(out, ref) < TOLERANCE[dtype], (m, interleaved, split, _rel(out, ref))
            out = wo.dequantized_matmul(x, weight, params["weight_scale"], params.get("weight_zero"), bits, interleaved)
            assert _rel(out, ref) < TOLERANCE[dtype], (m, interleaved)


@pytest.mark.interpreter
@pytest.mark.parametrize("algo, group", [("W8A16", None), ("W4A16", None), ("W4A16_AWQ", 32), ("W4A16", 16)])
@pytest.mark.parametrize("k", [40, 36, 38])
def test_interpreted_engine_layout_of_widths_without_whole_blocks(algo, group, k):
    """Rows of whole int32 words (40 columns) or not (int4 36, int8 38): read as words or bytes; groups of 16 and
    32 make 16- and 32-column steps."""
    from kiln.kernels.triton import weight_only as wo

    if algo != "W8A16" and k % 2:
        pytest.skip("int4 needs an even width")
    x, params, bits, ref = _case(algo, group, 24, k, 7, torch.float32, seed=k)
    out = wo.weight_only_matmul(x, params["weight"], params["weight_scale"], params.get("weight_zero"), bits)
    assert _rel(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.interpreter
@pytest.mark.parametrize("algo, group", FORMATS)
def test_interpreted_dequantize_is_the_reference_matrix(algo, group):
    from kiln.kernels.triton import weight_only as wo

    x, params, bits, ref = _case(algo, group, 40, 544, 6, torch.float32)
    matrix = quant.dequantize_weight(algo, params)
    for interleaved, weight in _layouts(params, bits):
        w = wo.dequantize(weight, params["weight_scale"], params.get("weight_zero"), bits, 544, interleaved,
                          torch.float32)
        assert torch.allclose(w, matrix, rtol=1e-6, atol=1e-7), interleaved
        out = wo.dequantized_matmul(x, weight, params["weight_scale"], params.get("weight_zero"), bits, interleaved)
        assert _rel(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.interpreter
@pytest.mark.parametrize("algo, group", [("W4A16_AWQ", 128), ("W4A16", 16)])
def test_interpreted_weight_only_matmul_picks_a_path(algo, group):
    """By rows (DEQUANTIZE_MIN_ROWS), and groups of 16 interleaved (narrower than a block) dequantized."""
    from kiln.kernels.triton import tuning, weight_only as wo

    for m in (5, tuning.DEQUANTIZE_MIN_ROWS[4]):
        x, params, bits, ref = _case(algo, group, 40, 544, m, torch.float16, seed=m)
        for interleaved, weight in _layouts(params, bits):
            out = wo.weight_only_matmul(x, weight, params["weight_scale"], params.get("weight_zero"), bits,
                                        interleaved)
            assert out.shape == (m, 40) and _rel(out, ref) < TOLERANCE[torch.float16], (m, interleaved)
