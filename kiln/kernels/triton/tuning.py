"""What the GPU kernels were tuned to: per-shape tables measured on an H200, the rules for shapes outside them, and
TritonOptions, the choices a test or benchmark may make differently (handed to TritonOps at load).

Plain data: importable without Triton (kiln.kernels reads TritonOptions on every install). Each table names the
benchmark that measured it: benchmarks/weight_only_gemm.py and benchmarks/moe_bench.py as they are; the kernel
phases of benchmarks/gpu_suite.py (int4_mma, quant_kernels, attn_sweep, attn_split, attn_fused, decode_fusions) as
they were before commit 42f4f80 (`git show 42f4f80^:benchmarks/gpu_suite.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

INT4_MMA_CHOICES = ("measured", "all", "off")


@dataclass(frozen=True)
class TritonOptions:
    """Choices of TritonOps, fixed at load. The defaults are the measured fastest."""

    context_fmha: bool = True
    """Prompt (context) attention by the Triton kernel; False: by the reference (PluginConfig.context_fmha)."""
    fp8_context_fmha: bool = False
    """Steps with prompt tokens over an e4m3 cache quantize each query row to e4m3 (its own scale) and multiply it
    by the cached keys on the FP8 tensor cores; P·V stays 16-bit (PluginConfig.use_fp8_context_fmha)."""
    fp8_fast_accumulation: bool = True
    """FP8 products accumulate at the tensor cores' full rate (PluginConfig.fp8_fast_accumulation)."""
    pdl: bool = True
    """Programmatic dependent launch on sm_90+ (PluginConfig.programmatic_dependent_launch)."""
    int4_mma: str = "measured"
    """Which int4 layers int4_mma computes (those it takes): "measured" those faster on it than on the CUDA-core GEMV
    (INT4_MMA_SHAPES, else few row blocks per SM), "all", or "off"."""
    silu_in_gemv: tuple[int, ...] = (8,)
    """Bit widths whose gate/up rows the CUDA-core decode GEMV pairs at load to write SiLU(gate)·up itself: int8
    +4.4% at batch 1, int4 -6.4% (H200; gpu_suite's decode_fusions sweep, in git history)."""
    fold_norms: bool = True
    """At one row, o/down on int4_mma add the residual and hand the next RMSNorm to qkv/gate_up on int4_mma
    (kiln.kernels.fusion): 8B W4A16_AWQ batch 1, 550.4 -> 578.6 tok/s (22 runs, H200)."""
    refittable: bool = False
    """Every quantized layer's layout follows from its shapes alone, never from its values, so that new weights
    (refit: BuildConfig.use_refit) pack into the storage the old ones were packed into: int4 group scales then stay
    float32 where fp16 would have held them."""

    def __post_init__(self):
        if self.int4_mma not in INT4_MMA_CHOICES:
            raise ValueError(f"TritonOptions.int4_mma={self.int4_mma!r}: expected one of {INT4_MMA_CHOICES}")
        if not set(self.silu_in_gemv) <= {4, 8}:
            raise ValueError(f"TritonOptions.silu_in_gemv={self.silu_in_gemv!r}: bit widths are 4 and 8")


# --- decode attention: split-K partitions (partitions.decode_partitions) ---------------------------------------
PARTITION_TOKENS = 512   # keys a decode-attention program covers (multi_block_mode)
BUSY_PROGRAMS = 264      # two programs per multiprocessor of an H100/H200
BUSY_WARPS = 2048        # one-warp programs (mma_decode_attention): ~16 per multiprocessor
LONG_CONTEXT = 1024      # sequences longer than this split whatever the batch size
MIN_PARTITION = 64       # keys of the shortest partition: four 16-key steps of one warp, one tile of the Triton kernel
# Small batches split down to MIN_PARTITION so that programs × partitions fill the GPU: batch 1 over 256 keys 7.9 ->
# 4.8 µs, over 1024 keys 16.6 -> 6.6 µs (gpu_suite's attn_split sweep, in git history).

# --- paged attention: keys per tile, (num_warps, num_stages) -----------------------------------------------------
ATTENTION_TILE = 64                  # bf16 and int8 caches
DECODE_FP8_TILE = 128                # decode over an e4m3 cache: 5% faster at 512 sequences of 128-256 keys, 14% at
                                     # 256 of 1-2k (gpu_suite's attn_sweep, in git history)
ATTENTION_LAUNCH = (4, 2)
# Steps with prompt tokens (16-bit queries): keys per tile, (num_warps, num_stages), query rows (tokens × the KV
# head's query heads) a program holds, and the causal split (tiles below the diagonal without the mask). One causal
# sequence, GQA 8:1, head dim 128, on an H100 (benchmarks/gpu_suite.py --phases context_attention), TFLOP/s with a
# bf16 / FP8 cache: at 2k tokens 262 / 240 against 240 / 202 for tile 64, (4, 2), 64 rows, no split; at 8k 388 / 323
# against 293 / 237 (torch SDPA flash: 204 at 2k, 330 at 8k). GPUs whose shared memory cannot hold its K/V stages
# keep the general tiles (paged_attention.attention_config).
PROMPT_ATTENTION = (128, (8, 3), 128, True)
# FP8 queries over an FP8 cache (use_fp8_context_fmha): the same tile with 2 stages, TFLOP/s on an H100 at 2k / 8k /
# 32k tokens 301 / 439 / 442 against 268 / 379 / 416 with 3 stages (level at 1k: 144 against 148).
PROMPT_ATTENTION_FP8Q = (128, (8, 2), 128, True)

# --- weight-only decode GEMV (CUDA cores, interleaved layout) ----------------------------------------------------
# (N, K, bits) → (BLOCK_N, BLOCKS, PREFETCH) fastest at one decode row for the Llama-3.1-8B shapes
# (gpu_suite's quant_kernels sweep, in git history); other shapes: gemv.gemv_config's rule.
GEMV_CONFIGS = {(6144, 4096, 4): (8, 64, True), (4096, 4096, 4): (4, 64, True), (28672, 4096, 4): (8, 64, True),
                (4096, 14336, 4): (4, 64, True), (6144, 4096, 8): (4, 64, True), (4096, 4096, 8): (4, 128, True),
                (28672, 4096, 8): (8, 128, True), (4096, 14336, 8): (4, 128, True)}
# the configurations that phase sweeps (and the GPU tests check)
GEMV_SWEEP = [(8, 64, True), (8, 64, False), (16, 64, True), (4, 64, True), (8, 128, True), (4, 128, True),
              (8, 32, True), (16, 32, True)]

# --- FP8 products of few rows (fp8_decode, the weight as the MMA's wide side) -------------------------------------
@dataclass(frozen=True)
class Fp8DecodeTile:
    """fp8_decode's tile: BLOCK_N weight rows a program, BLOCK_K columns a step, K split over `split` programs."""
    block_n: int = 64
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    split: int = 1


# Products of up to FP8_DECODE_ROWS rows run on fp8_decode instead of torch._scaled_mm (0: never). (N, K) → its
# tile (None: that shape stays on cuBLAS); other shapes FP8_DECODE_CONFIG. One row on an H100, µs
# (benchmarks/gpu_suite.py --phases fp8_decode), _scaled_mm → fp8_decode: 8B qkv 13.7 → 10.4, o 13.5 → 7.6,
# gate_up 59.6 → 40.3, down 40.3 → 21.7, FP8 LM head 217.3 → 167.1; 70B qkv 32.3 → 30.9, o 27.1 → 23.9, gate_up
# 171.3 → 149.7, down 106.3 → 76.4 (3.1 TB/s). Splitting K was never faster, even for the 64-block o and down.
# Llama-3.1-8B FP8 batch 1: 192.8 → 284.2 tok/s. Products of 2-16 rows read the same weight tiles (x padded to 16).
FP8_DECODE_ROWS = 16
FP8_DECODE_CONFIG = Fp8DecodeTile(64, 256, 4, 6)
FP8_DECODE_CONFIGS: dict[tuple[int, int], Fp8DecodeTile | None] = {
    (6144, 4096): Fp8DecodeTile(64, 128, 4, 8), (28672, 4096): Fp8DecodeTile(128, 256, 4, 4),
    (128256, 4096): Fp8DecodeTile(64, 256, 4, 4)}

# --- int4 on the tensor cores (int4_mma) -------------------------------------------------------------------------
# (N, K) → whether int4_mma's one-row product beats the CUDA-core GEMV in the model (benchmarks/gpu_suite.py
# --phases int4_mma and batch-1 decode; Llama-3.1-8B shapes): o 3.1 µs, down 10.8, gate_up 18.5 (CUDA-core 21.4),
# LM head 73.9 (86.6), qkv 4.2 (6.0) with its RMSNorm folded in. Other shapes: int4_mma where it has at most two
# row blocks per SM, as o and down do (the CUDA-core GEMV lags with few, long rows).
INT4_MMA_SHAPES = {(4096, 4096): True, (4096, 14336): True, (6144, 4096): True, (28672, 4096): True,
                   (128256, 4096): True}
# (N, K) → (warps, chunks a warp per step, row blocks a program) fastest at one row after a short kernel, as in a
# decode step (benchmarks/gpu_suite.py --phases int4_mma): qkv 4.2 µs, o 3.1, gate_up 18.5 (two row blocks a program
# share x and Σ x), down 10.8, LM head 73.9. Other shapes and more than 8 rows: int4_mma.config's rule.
INT4_MMA_LAYOUTS = {(6144, 4096): (4, 8, 1), (4096, 4096): (8, 4, 1), (28672, 4096): (2, 2, 2),
                    (4096, 14336): (16, 1, 1), (128256, 4096): (4, 2, 1)}
# products of up to this many 16-row slices of x on int4_mma, more rows dequantized for cuBLAS: two slices beat
# dequantize + cuBLAS (8B o: 2 × 13.9 vs 22.6 + ~13 µs, down: 2 × 30.4 vs 74.4 + ~32); four no longer do on o
FRAGMENT_SLICES = 2

# --- weight-only products of more rows (weight_only) -------------------------------------------------------------
# Rows from which weight_only_matmul dequantizes the weight to x's dtype for cuBLAS, per weight bits: int8 wins from
# 512 rows on every 8B shape and loses at 128; int4 wins at 2048 and loses at 512 (benchmarks/weight_only_gemm.py).
DEQUANTIZE_MIN_ROWS = {4: 1024, 8: 256}

GATHER, PLANES, RESHAPE, RESHAPE_INNER = 0, 1, 2, 3     # how a tile's levels are unpacked (MmaConfig.unpack)


@dataclass(frozen=True)
class MmaConfig:
    """Tile of the weight-only tensor-core kernel: BLOCK_N weight rows × BLOCK_M rows of x per program, BLOCK_K
    columns a step (at most the group). split: programs sharing one tile's K (0: enough to fill the GPU). unpack:
    GATHER loads each unit once per value it holds (cached) into one (BLOCK_N, BLOCK_K) tile; PLANES loads units
    once and runs one dot per value plane; RESHAPE loads once and reshapes (rows, values, units) into one tile,
    RESHAPE_INNER (rows, units, values): each unit's values side by side."""
    block_n: int = 64
    block_m: int = 16
    block_k: int = 128
    unpack: int = GATHER
    split: int = 0
    num_warps: int = 4
    num_stages: int = 3


# Per weight bits, (rows of x up to, MmaConfig): the first whose bound holds. The fastest over the four 8B shapes
# (benchmarks/weight_only_gemm.py).
MMA_CONFIGS = {
    4: [(16, MmaConfig(block_n=128, block_m=16, unpack=PLANES)),
        (32, MmaConfig(block_n=128, block_m=32, unpack=PLANES)),
        (64, MmaConfig(block_n=128, block_m=64, unpack=RESHAPE_INNER)),
        (1 << 62, MmaConfig(block_n=128, block_m=128, unpack=RESHAPE, num_warps=8))],
    8: [(16, MmaConfig(block_n=128, block_m=16, unpack=PLANES)),
        (32, MmaConfig(block_n=128, block_m=32, unpack=PLANES)),
        (1 << 62, MmaConfig(block_n=128, block_m=64, unpack=PLANES, num_warps=8))],
}


# --- the fused MoE (fused_moe) -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoeTile:
    """One grouped GEMM's tile: BLOCK_N output columns (gate/up: of each half) × BLOCK_K input columns a step."""
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 1      # row blocks that consecutive programs walk before the next column tile (L2 reuse)


@dataclass(frozen=True)
class MoeConfig:
    block_m: int          # rows of a block: every expert's segment is padded to a multiple of it
    gate_up: MoeTile
    down: MoeTile
    tma: bool = False     # float and FP8 experts: operands gathered in expert order, both read by the TMA engine


# (average rows per expert, T·k / E, up to; MoeConfig). Few rows (decode): 16-row blocks and narrow tiles, so that
# the programs streaming the two routed experts' weights fill the GPU; many rows: 64/128-row blocks, whose tiles
# are reused from L2 by GROUP_M neighbouring row blocks. Measured with `benchmarks/moe_bench.py` (--sweep for the
# alternatives) on Mixtral-8x7B's shapes, one H200. MOE_CONFIGS, the int8/int4 experts' table: int4 at one token
# 354 µs (its unpacking, not its bytes, bounds it). Float experts step 256 deep at one token: bf16
# 200 µs (3.5 TB/s of the two routed experts; 237 µs 128 deep); bf16 at 4096 tokens 507 TFLOP/s. FP8 experts from
# 48 rows take 128 × 128 tiles, from 96 rows 128-row blocks: 512 tokens 672 µs, 4096 tokens 3.11 ms (928 TFLOP/s;
# 917 µs and 4.30 ms on the 64 × 64 tiles of the int table); from 96 rows both operands through the TMA engine, 4
# stages deep (H100: 1024 tokens 1037 → 972 µs, 4096 tokens 3.18 → 2.99 ms; static FP8 978 → 917 µs, 3.08 → 2.86 ms;
# the pointer kernels 4 stages deep: 968 µs and 3.22 ms; the same error against the reference either way).
MOE_CONFIGS = [
    (16, MoeConfig(16, MoeTile(64, 128, 4, 4), MoeTile(32, 128, 4, 4))),
    (48, MoeConfig(32, MoeTile(64, 128, 4, 4), MoeTile(64, 128, 4, 4))),
    (192, MoeConfig(64, MoeTile(64, 64, 4, 4, 8), MoeTile(128, 64, 4, 4, 8))),
    (1 << 62, MoeConfig(128, MoeTile(64, 64, 8, 3, 8), MoeTile(128, 64, 8, 3, 8))),
]
MOE_FLOAT_CONFIGS = [(16, MoeConfig(16, MoeTile(64, 256, 4, 3), MoeTile(64, 256, 4, 3))), *MOE_CONFIGS[1:]]
MOE_FP8_CONFIGS = MOE_CONFIGS[:2] + [
    (96, MoeConfig(64, MoeTile(128, 128, 8, 3, 8), MoeTile(128, 128, 8, 3, 8))),
    (1 << 62, MoeConfig(128, MoeTile(128, 128, 8, 4, 8), MoeTile(128, 128, 8, 4, 8), tma=True)),
]
# Rows per expert (T·k / E) at which the experts run on torch's grouped GEMMs (fused_moe.grouped_products, CUTLASS)
# instead of the Triton kernels above: "bf16" and "fp8" (per-token) experts → [least, most) rows (most None: no
# bound); a format not listed never does. Mixtral's shape on an H100 (benchmarks/moe_bench.py --backends
# triton,grouped): bf16 1.26x faster at 64 tokens, 1.21x at 512, 1.04x at 1024, 1.19x at 4096, 1.32x at 16384
# (0.88x at 1 token); FP8 1.14x at 64 tokens but 0.60x at 512, 0.82x at 1024, 0.97x at 4096 (1.08x at 16384).
MOE_GROUPED_MM_ROWS: dict[str, tuple[int, int | None]] = {"bf16": (16, None), "fp8": (16, 64)}
# Rows per expert (T·k / E) from which float and FP8 experts on the Triton kernels read both operands through the TMA
# engine (MoeConfig.tma, whatever the tables above say); None: as the tables say.
MOE_TMA_ROWS: int | None = None
MOE_SHARED_MEMORY = 224 << 10     # bytes of operand stages a grouped-GEMM program may hold (H100/H200: 227 KB)
