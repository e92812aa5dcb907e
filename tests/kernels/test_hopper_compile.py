"""Triton kernels compiled for Hopper (sm_90) on a machine without a GPU: Triton's own compiler and ptxas lower
them, so a kernel change that does not build for the GPU it is tuned for fails here, and the PTX shows which tensor
core instructions a path uses. Numerics are the interpreter's and the GPU tests' job."""
from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kiln.kernels.triton import decode_attention as da  # noqa: E402
from kiln.kernels.triton import paged_attention as pa  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)


def _ptx(fn, signature: dict, constants: dict, warps: int, stages: int) -> str:
    """The PTX of `fn` for sm_90, its pointers (and cache_half) 16-byte aligned as a launch specializes torch's
    tensors."""
    aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
               for name, kind in signature.items() if kind.startswith("*") or name == "cache_half"}
    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    source = ASTSource(fn, signature=signature, attrs=aligned,
                       constexprs={(fn.arg_names.index(name),): value for name, value in constants.items()})
    return triton.compile(source, target=HOPPER, options=dict(num_warps=warps, num_stages=stages)).asm["ptx"]


def _prompt_attention_ptx(cache: str, kv_quant: int, fp8_queries: bool, word_loads: bool, num_parts: int = 1,
                          tile: int = 128, block_q: int = 16, warps: int = 8, stages: int = 3) -> str:
    """The PTX of _paged_attention_kernel for bf16 queries over a `cache` ("*bf16" / "*fp8e4nv") of 8 KV heads of
    dim 128 (GQA 4:1, blocks of 64 tokens)."""
    fn = pa._paged_attention_kernel
    signature = {"q_ptr": "*bf16", "cache_ptr": cache, "cache_half": "i64", "block_tables_ptr": "*i32",
                 "bt_stride": "i32", "seq_lens_ptr": "*i32", "q_start_ptr": "*i32", "out_ptr": "*bf16",
                 "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "scale": "fp32",
                 "window": "i32", "kv_scale_ptr": "*fp32"}
    constants = dict(KV_HEADS=8, GROUP=4, GROUP_PAD=4, DIM=128, BLOCK_TOKENS=64, TILE=tile, BLOCK_Q=block_q,
                     PART_TOKENS=pa.ONE_PARTITION if num_parts == 1 else 512, NUM_PARTS=num_parts,
                     PRECISION="tf32", KV_QUANT=kv_quant, WORD_LOADS=word_loads, CAUSAL_SPLIT=num_parts == 1,
                     FP8_QUERIES=fp8_queries, PDL=True)
    return _ptx(fn, signature, constants, warps, stages)


def _products(ptx: str) -> list[str]:
    """The PTX lines of Hopper's asynchronous tensor-core products."""
    return [line for line in ptx.splitlines() if "wgmma.mma_async" in line]


@pytest.mark.parametrize("cache, kv_quant", [("*bf16", 0), ("*fp8e4nv", 2)])
def test_prompt_attention_runs_on_hopper_tensor_cores(cache, kv_quant):
    """The prompt tiles (tuning.PROMPT_ATTENTION) over a bf16 and an e4m3 cache: both products on wgmma, 16-bit,
    the K/V tiles loaded by asynchronous copies (software-pipelined over num_stages)."""
    ptx = _prompt_attention_ptx(cache, kv_quant, fp8_queries=False, word_loads=True)
    products = _products(ptx)
    assert products and not any("e4m3" in line for line in products)
    assert "cp.async" in ptx


@pytest.mark.parametrize("word_loads", [True, False])
def test_fp8_queries_multiply_the_cached_keys_in_e4m3(word_loads):
    """use_fp8_context_fmha: Q·Kᵀ on e4m3 wgmma, P·V on 16-bit wgmma."""
    products = _products(_prompt_attention_ptx("*fp8e4nv", 2, fp8_queries=True, word_loads=word_loads))
    assert any("e4m3.e4m3" in line for line in products)
    assert any("e4m3" not in line for line in products)


def test_split_decode_attention_compiles():
    """Decode rows over four partitions (multi_block_mode): the partials' path, a program's four token slots × four
    heads making the 16 rows a product needs, as paged_attention launches it."""
    assert "ex2.approx" in _prompt_attention_ptx("*bf16", 0, fp8_queries=False, word_loads=True, num_parts=4,
                                                 tile=64, block_q=4, warps=4, stages=2)


def test_fused_decode_attention_compiles():
    """The fused rotary + cache write + decode attention of one-token steps (split over four partitions, merged by
    the last program), bf16 cache, GQA 4:1: its products on the tensor cores."""
    signature = {"qkv_ptr": "*bf16", "pos_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_ptr": "*i64",
                 "cache_ptr": "*bf16", "cache_half": "i64", "block_tables_ptr": "*i32", "bt_stride": "i32",
                 "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
                 "part_acc_ptr": "*fp32", "arrivals_ptr": "*i32", "scale": "fp32", "window": "i32"}
    constants = dict(KV_HEADS=8, GROUP=4, ROWS=16, DIM=128, BLOCK_TOKENS=32, TILE=64, PART_TOKENS=512, NUM_PARTS=4,
                     PARTS_PAD=4, PRECISION="tf32", PDL=True)
    ptx = _ptx(da._decode_attention_kernel, signature, constants, warps=4, stages=2)
    assert "mma" in ptx and "ex2.approx" in ptx
