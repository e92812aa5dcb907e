"""A mixture-of-experts layer on the GPU (Mixtral): route, group the tokens by expert and run every expert's
products in one grouped GEMM per projection. Reference: `reference.moe` (the CPU path and the oracle).

One launch sequence per layer, each of a size fixed by the token count T (so a decode step is CUDA-graph
capturable: no host synchronisation, no output shape that depends on the routing):

    logits = x W_router^T                            (T, E)    cuBLAS, in x's dtype like the reference
    _route_kernel                                    (T, k)    softmax, top k, renormalised (Mixtral) → ids, weights
    _align_kernel   (one program)                    sorted    each local expert's entries (entry = token·k + slot)
                                                               in a segment padded to a multiple of BLOCK_M rows,
                                                               padding marked T·k; per BLOCK_M block its expert or -1
    [quantize_fp8_rows(x)]                           FP8 experts: x in e4m3, a scale per token or the static one
    _gate_up_kernel                                  act (S, I) = SiLU(x W_gate^T)·(x W_up^T), rows in sorted order
    [quantize_fp8_rows(act)]                         FP8 with per-token scales (static: _gate_up_kernel stores e4m3)
    _down_kernel                                     partial (T·k, H) float32 = routing weight · act W_down^T
    _sum_top_k_kernel                                out (T, H) = Σ over the token's k entries, in x's dtype

The sorted buffer has S = T·k + min(T·k, E)·(BLOCK_M − 1) rows (at most min(T·k, E) experts have entries, each
padded by less than a block), rounded up to whole blocks; blocks past the last segment have expert -1 and their
programs return at once. Entries routed to another rank's experts (expert parallel) are left out and summed as 0.

With MoeConfig.tma (float and FP8 experts, Hopper) the routed rows are first gathered in sorted order (e4m3 for
FP8 experts) and both operands of the two GEMMs are read through tensor descriptors (the TMA engine).

Expert weights are read in the engine layout (kernels/quant.py) with a leading expert dimension: float (E, N, K);
FP8 e4m3 (E, N, K) with a float32 scale per output channel (E, N), activations per token or with the static
`input_scale`; W8A16 int8 (E, N, K) per channel; W4A16 packed int4 (E, N, K/2) with scales (and zero points)
(E, N, groups) — per group the product is s·(Σ x·q − z·Σ x), q the integer levels, exact in 16-bit floats.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:                                   # Triton < 3.4: no host-side tensor descriptors
    TensorDescriptor = None

from ..quant import int4_group_size
from .launch import launch_args, shared_memory, wait_for_inputs
from .norms import fp8_row_scale, quantize_fp8_rows, silu_and_mul, silu_and_mul_fp8, silu_mul, store_fp8_row
from . import tuning
from .tuning import MOE_CONFIGS, MOE_FLOAT_CONFIGS, MOE_FP8_CONFIGS, MOE_SHARED_MEMORY, MoeConfig, MoeTile

FLOAT, FP8, INT8, INT4 = 0, 1, 2, 3          # how a projection's weights are stored (ExpertWeights.format)
_FP8, _INT8, _INT4 = tl.constexpr(FP8), tl.constexpr(INT8), tl.constexpr(INT4)     # the same, inside kernels
TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def moe_config(tokens: int, top_k: int, experts: int, weights: int = FLOAT) -> MoeConfig:
    """The measured tiles for `tokens` routed to top_k of `experts` experts stored as `weights` (FLOAT, FP8, ...)."""
    table = {FLOAT: MOE_FLOAT_CONFIGS, FP8: MOE_FP8_CONFIGS}.get(weights, MOE_CONFIGS)
    rows = tokens * top_k / experts
    config = next(config for bound, config in table if rows <= bound)
    if tuning.MOE_TMA_ROWS is not None and weights in (FLOAT, FP8):
        config = replace(config, tma=rows >= tuning.MOE_TMA_ROWS)
    return config


@dataclass(frozen=True)
class ExpertWeights:
    """One projection of every local expert, as the grouped GEMM reads it."""
    format: int
    weight: torch.Tensor                  # (E, N, K) float / e4m3 / int8, or (E, N, K/2) packed int4
    scale: torch.Tensor | None            # (E, N, groups) float32; per channel: one group
    zero: torch.Tensor | None             # int4 zero points (E, N, groups), or None
    group: int                            # int4 input columns per scale; 0: one scale per row
    input_scale: torch.Tensor | None      # FP8: the static activation scale (1,); None: one per token

    @property
    def out_features(self) -> int:
        return self.weight.shape[1]

    @property
    def in_features(self) -> int:
        return self.weight.shape[2] * (2 if self.format == INT4 else 1)


def expert_weights(w: torch.Tensor | dict, algo: str | None) -> ExpertWeights:
    """A projection's stacked experts: a float tensor, or a dict of `algo`'s tensors (kernels/quant.py) each with a
    leading expert dimension (input_scale: one for all)."""
    if not isinstance(w, dict):
        return ExpertWeights(FLOAT, w, None, None, 0, None)
    experts, rows = w["weight"].shape[:2]
    scale = w["weight_scale"].reshape(experts, rows, -1)
    if algo == "W8A16":
        return ExpertWeights(INT8, w["weight"], scale, None, 0, None)
    if algo is not None and algo.startswith("W4A16"):
        zero = w.get("weight_zero")
        groups = scale.shape[2]
        group = 0 if groups == 1 else int4_group_size(w["weight"].shape[2] * 2, groups)
        return ExpertWeights(INT4, w["weight"], scale, None if zero is None else zero.reshape(scale.shape), group,
                             None)
    if algo is not None and algo.startswith("FP8"):
        return ExpertWeights(FP8, w["weight"], scale, None, 0, w.get("input_scale"))
    raise ValueError(f"MoE experts run float, W8A16, W4A16* or FP8* weights, not {algo!r}")


# --- routing ---------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["T"])
def _route_kernel(logits_ptr, ids_ptr, weights_ptr, T, E, E_PAD: tl.constexpr, TOP_K: tl.constexpr,
                  K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    """BLOCK_T tokens: softmax over the E logits (float32), the TOP_K largest (lowest index first among equals),
    their probabilities renormalised to sum to 1 where RENORMALIZE."""
    wait_for_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_PAD)
    ok = rows < T
    logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * E + cols[None, :],
                     mask=ok[:, None] & (cols < E)[None, :], other=0.0).to(tl.float32)
    logits = tl.where((cols < E)[None, :], logits, float("-inf"))
    p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    slots = tl.arange(0, K_PAD)
    chosen = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    ids = tl.zeros([BLOCK_T, K_PAD], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)
        index = tl.min(tl.where(p == best[:, None], cols[None, :], E_PAD), axis=1)
        chosen = tl.where(slots[None, :] == j, best[:, None], chosen)
        ids = tl.where(slots[None, :] == j, index[:, None], ids)
        p = tl.where(cols[None, :] == index[:, None], -1.0, p)
    if RENORMALIZE:
        chosen = chosen / tl.sum(chosen, axis=1)[:, None]
    at = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
    mask = ok[:, None] & (slots < TOP_K)[None, :]
    tl.store(ids_ptr + at, ids, mask=mask)
    tl.store(weights_ptr + at, chosen, mask=mask)


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          launch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts (T, k) int32, weights (T, k) float32) of the router's logits (T, E)."""
    t, e = logits.shape
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    block = 16
    _route_kernel[(triton.cdiv(t, block),)](logits, ids, weights, t, e, E_PAD=triton.next_power_of_2(e),
                                            TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
                                            RENORMALIZE=renormalize, BLOCK_T=block, num_warps=4, **launch_args(launch))
    return ids, weights


# --- sorting the entries by expert ------------------------------------------------------------------------------
@triton.jit
def _expert_hits(ids_ptr, start, ENTRIES, FIRST, EXPERTS, experts, CHUNK: tl.constexpr):
    """(CHUNK, E_PAD) int32: 1 where entry start + i goes to local expert j (experts = arange(E_PAD))."""
    entry = start + tl.arange(0, CHUNK)
    local = tl.load(ids_ptr + entry, mask=entry < ENTRIES, other=-1) - FIRST
    return ((local[:, None] == experts[None, :]) & (experts < EXPERTS)[None, :] & (entry < ENTRIES)[:, None]
            ).to(tl.int32)


@triton.jit(do_not_specialize=["ENTRIES", "SLOTS"])
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, ends_ptr, slot_of_ptr, ENTRIES, SLOTS, FIRST, EXPERTS,
                  E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """One program: count each local expert's entries, lay their segments out back to back (each padded to whole
    blocks), write every entry at its expert's next slot (entries in order; slot_of: each entry's slot, -1 for
    another rank's expert), ENTRIES at every other of the SLOTS slots, per block its expert (-1 past the last
    segment), and each segment's end. Entries and padding write disjoint slots."""
    wait_for_inputs(PDL)
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], tl.int32)
    for start in range(0, ENTRIES, CHUNK):
        counts += tl.sum(_expert_hits(ids_ptr, start, ENTRIES, FIRST, EXPERTS, experts, CHUNK), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(ends_ptr + experts, ends, mask=experts < EXPERTS)
    taken = tl.zeros([E_PAD], tl.int32)
    for start in range(0, ENTRIES, CHUNK):
        hits = _expert_hits(ids_ptr, start, ENTRIES, FIRST, EXPERTS, experts, CHUNK)
        before = tl.cumsum(hits, axis=0) - hits + taken[None, :]          # the expert's entries before this one
        slot = tl.sum(hits * (starts[None, :] + before), axis=1)
        local = tl.sum(hits, axis=1) > 0
        entry = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + slot, entry, mask=local)
        tl.store(slot_of_ptr + entry, tl.where(local, slot, -1), mask=entry < ENTRIES)
        taken += tl.sum(hits, axis=0)
    for start in range(0, SLOTS, CHUNK):
        slot = start + tl.arange(0, CHUNK)
        offset = slot[:, None] - starts[None, :]
        used = tl.sum(((offset >= 0) & (offset < counts[None, :])).to(tl.int32), axis=1) > 0
        tl.store(sorted_ptr + slot, ENTRIES, mask=(slot < SLOTS) & ~used)
    for start in range(0, SLOTS // BLOCK_M, CHUNK):
        block = start + tl.arange(0, CHUNK)
        first = block[:, None] * BLOCK_M
        inside = (first >= starts[None, :]) & (first < ends[None, :])
        expert = tl.sum(tl.where(inside, experts[None, :] + 1, 0), axis=1) - 1
        tl.store(block_expert_ptr + block, expert, mask=block < SLOTS // BLOCK_M)


def sorted_slots(tokens: int, top_k: int, experts: int, block_m: int) -> int:
    """Rows of the sorted buffer: every entry plus the worst-case padding, in whole blocks."""
    entries = tokens * top_k
    return triton.cdiv(entries + min(entries, experts) * (block_m - 1), block_m) * block_m


class Alignment(NamedTuple):
    """The routed entries (entry = token·k + slot) grouped by local expert, segments padded to whole blocks."""
    sorted_ids: torch.Tensor      # (S,) int32: the entry in each slot, T·k for padding
    block_expert: torch.Tensor    # (S / BLOCK_M,) int32: each block's expert, -1 past the last segment
    ends: torch.Tensor            # (E,) int32: where each expert's segment ends (the grouped GEMMs' offsets)
    slot_of: torch.Tensor         # (T·k,) int32: each entry's slot, -1 for an entry routed to another rank


def align(ids: torch.Tensor, block_m: int, first_expert: int, experts: int,
          launch: dict | None = None) -> Alignment:
    """The entries of ids (T, k) routed to the local experts first_expert .. first_expert + experts - 1, grouped."""
    entries = ids.numel()
    slots = sorted_slots(ids.shape[0], ids.shape[1], experts, block_m)
    sorted_ids = torch.empty(slots, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(slots // block_m, dtype=torch.int32, device=ids.device)
    ends = torch.empty(experts, dtype=torch.int32, device=ids.device)
    slot_of = torch.empty(entries, dtype=torch.int32, device=ids.device)
    e_pad = triton.next_power_of_2(experts)
    chunk = max(16, min(1024, 8192 // e_pad))
    _align_kernel[(1,)](ids, sorted_ids, block_expert, ends, slot_of, entries, slots, first_expert, experts,
                        E_PAD=e_pad, BLOCK_M=block_m, CHUNK=chunk, num_warps=4, **launch_args(launch))
    return Alignment(sorted_ids, block_expert, ends, slot_of)


# --- the grouped GEMMs ------------------------------------------------------------------------------------------
@triton.jit
def _tile_of(pid, NUM_M, NUM_N, GROUP_M: tl.constexpr):
    """(row block, column tile) of program pid: GROUP_M row blocks per column tile before the next one."""
    per_group = GROUP_M * NUM_N
    first_m = (pid // per_group) * GROUP_M
    size = tl.minimum(NUM_M - first_m, GROUP_M)
    return first_m + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _rows_tile(a_ptr, rows, valid, k0, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_K of the rows `rows` of a (·, K) matrix; invalid rows and columns past K read 0."""
    cols = k0 + tl.arange(0, BLOCK_K)
    ptrs = a_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
    if EVEN_K:
        return tl.load(ptrs, mask=valid[:, None], other=0.0)
    return tl.load(ptrs, mask=valid[:, None] & (cols < K)[None, :], other=0.0)


@triton.jit
def _int_as(levels, DTYPE: tl.constexpr):
    """Integer levels (|level| ≤ 128, exact in every float type) in DTYPE, through float32: Triton's interpreter
    converts integers to bfloat16 wrongly."""
    return levels.to(tl.float32).to(DTYPE)


@triton.jit
def _weight_tile(w_ptr, rows, k0, K, W_STRIDE, FORMAT: tl.constexpr, EVEN_K: tl.constexpr, DTYPE: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Float, e4m3 or int8 weight rows `rows` (BLOCK_N,) over columns k0 .. k0 + BLOCK_K as the dot's right operand
    (BLOCK_K, BLOCK_N): values as stored, int8 levels in DTYPE."""
    cols = k0 + tl.arange(0, BLOCK_K)
    ptrs = w_ptr + rows[None, :].to(tl.int64) * W_STRIDE + cols[:, None]
    if EVEN_K:
        w = tl.load(ptrs)
    elif FORMAT == _INT8:
        w = tl.load(ptrs, mask=(cols < K)[:, None], other=0)
    else:
        w = tl.load(ptrs, mask=(cols < K)[:, None], other=0.0)
    if FORMAT == _INT8:
        w = _int_as(w, DTYPE)
    return w


@triton.jit
def _int4_planes(w_ptr, rows, k0, W_STRIDE, HAS_ZERO: tl.constexpr, EVEN_K: tl.constexpr, DTYPE: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Packed int4 weight rows `rows` over columns k0 .. k0 + BLOCK_K as two right operands (BLOCK_K/2, BLOCK_N):
    the even columns' levels (low nibbles) and the odd ones' (high), in DTYPE, minus 8 without zero points. Each
    byte is loaded once and no value moves between lanes."""
    units = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    ptrs = w_ptr + rows[None, :].to(tl.int64) * W_STRIDE + units[:, None]
    if EVEN_K:
        packed = tl.load(ptrs)
    else:
        packed = tl.load(ptrs, mask=(units < W_STRIDE)[:, None], other=0)
    low, high = (packed & 0xF).to(tl.int32), (packed >> 4).to(tl.int32)
    if not HAS_ZERO:
        low, high = low - 8, high - 8
    return _int_as(low, DTYPE), _int_as(high, DTYPE)


@triton.jit
def _dot_step(acc, a, a_sum, w_ptr, s_ptr, z_ptr, rows, k0, K, W_STRIDE, GROUPS, FORMAT: tl.constexpr,
              GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, EVEN_K: tl.constexpr, FAST_ACCUM: tl.constexpr,
              PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + a (BLOCK_M, BLOCK_K) times the weight rows' step. int4: a's even and odd columns times the two planes
    of levels, each group's scale (and zero point, as z·Σa with a_sum = Σ over the step's columns of a) applied
    here, a per-channel scale at the end (_scaled) like int8's and FP8's. FP8 without fast accumulation adds each
    step's dot to acc in float32."""
    if FORMAT == _INT4:
        low, high = _int4_planes(w_ptr, rows, k0, W_STRIDE, HAS_ZERO, EVEN_K, a.dtype, BLOCK_K)
        a_even, a_odd = tl.split(tl.reshape(a, [a.shape[0], BLOCK_K // 2, 2]))
        part = tl.dot(a_odd, high, tl.dot(a_even, low, input_precision=PRECISION), input_precision=PRECISION)
        if GROUP > 0:
            at = rows * GROUPS + k0 // GROUP
            if HAS_ZERO:
                part -= a_sum[:, None] * tl.load(z_ptr + at)[None, :]
            part *= tl.load(s_ptr + at)[None, :]
        acc += part
    elif FORMAT == _FP8 and not FAST_ACCUM:
        acc += tl.dot(a, _weight_tile(w_ptr, rows, k0, K, W_STRIDE, FORMAT, EVEN_K, a.dtype, BLOCK_K))
    else:
        acc = tl.dot(a, _weight_tile(w_ptr, rows, k0, K, W_STRIDE, FORMAT, EVEN_K, a.dtype, BLOCK_K), acc,
                     input_precision=PRECISION)
    return acc


@triton.jit
def _scaled(acc, a_total, a_scale, s_ptr, z_ptr, rows, GROUPS, FORMAT: tl.constexpr, GROUP: tl.constexpr,
            HAS_ZERO: tl.constexpr):
    """acc with the scales not applied per step: FP8 activation × weight scales, int8 and per-channel int4 weight
    scales (int4 zero points as z·Σa, a_total the rows' sums)."""
    if FORMAT == _FP8:
        acc = acc * a_scale[:, None] * tl.load(s_ptr + rows * GROUPS)[None, :]
    elif FORMAT == _INT8:
        acc = acc * tl.load(s_ptr + rows * GROUPS)[None, :]
    elif FORMAT == _INT4 and GROUP == 0:
        if HAS_ZERO:
            acc -= a_total[:, None] * tl.load(z_ptr + rows * GROUPS)[None, :]
        acc = acc * tl.load(s_ptr + rows * GROUPS)[None, :]
    return acc


@triton.jit
def _row_sums(a, a_total, FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr):
    """(Σ of the step's columns of a per row, the running total) where int4 zero points need them."""
    if FORMAT == _INT4 and HAS_ZERO:
        a_sum = tl.sum(a.to(tl.float32), axis=1)
        if GROUP == 0:
            a_total += a_sum
    else:
        a_sum = a_total
    return a_sum, a_total


@triton.jit
def _block_rows(sorted_ptr, block_expert_ptr, pid_m, ENTRIES, BLOCK_M: tl.constexpr):
    """(expert, slots, entries, valid) of row block pid_m: its expert (-1: unused block), slot positions, the
    entries in them and which are real (not padding)."""
    expert = tl.load(block_expert_ptr + pid_m)
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    entries = tl.load(sorted_ptr + slots)
    return expert, slots, entries, entries < ENTRIES


@triton.jit
def _store_act(gate, up, out, cols, INTER, act_scale_ptr, DTYPE: tl.constexpr, FP8_ACT: tl.constexpr):
    """SiLU(gate)·up into the act rows at out (columns below INTER), gate and up rounded to DTYPE (the model's)
    first, as reference.silu_and_mul reads them; FP8_ACT: act / act_scale in e4m3."""
    act = silu_mul(gate.to(DTYPE), up.to(DTYPE))
    if FP8_ACT:
        act = tl.clamp(tl.math.div_rn(act.to(tl.float32), tl.load(act_scale_ptr)), -448.0, 448.0)
    tl.store(out, act.to(out.dtype.element_ty), mask=(cols < INTER)[None, :])


@triton.jit
def _store_partials(acc, entries, valid, cols, N, weights_ptr, partial_ptr):
    """The real entries' rows of acc times their routing weights into partial (T·k, N), columns below N."""
    safe = tl.where(valid, entries, 0).to(tl.int64)
    acc *= tl.load(weights_ptr + safe, mask=valid, other=0.0)[:, None]
    tl.store(partial_ptr + safe[:, None] * N + cols[None, :], acc, mask=valid[:, None] & (cols < N)[None, :])


@triton.jit(do_not_specialize=["ENTRIES", "NUM_M"])
def _gate_up_kernel(x_ptr, x_scale_ptr, sorted_ptr, block_expert_ptr, w_ptr, s_ptr, z_ptr, act_ptr, act_scale_ptr,
                    ENTRIES, NUM_M, INTER, K, W_STRIDE, GROUPS, TOP_K: tl.constexpr, FORMAT: tl.constexpr,
                    GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, FP8_ACT: tl.constexpr, FAST_ACCUM: tl.constexpr,
                    PRECISION: tl.constexpr, DTYPE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr):
    """act[slot] (BLOCK_M × BLOCK_N of I columns) = SiLU(gate)·up of each slot's token, x's row entry // TOP_K, by
    the block's expert: rows c and INTER + c of its (2·INTER, K) weight. Gate and up are rounded to DTYPE (the
    model's) before SiLU, as reference.silu_and_mul reads them; FP8_ACT stores act / act_scale in e4m3."""
    wait_for_inputs(PDL)
    pid_m, pid_n = _tile_of(tl.program_id(0), NUM_M, tl.cdiv(INTER, BLOCK_N), GROUP_M)
    expert, slots, entries, valid = _block_rows(sorted_ptr, block_expert_ptr, pid_m, ENTRIES, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out = act_ptr + slots[:, None].to(tl.int64) * INTER + cols[None, :]
    if expert < 0:                  # past the last segment: zeros, so that every row of act is defined
        tl.store(out, tl.zeros([BLOCK_M, BLOCK_N], act_ptr.dtype.element_ty), mask=(cols < INTER)[None, :])
        return
    tokens = tl.where(valid, entries // TOP_K, 0)
    rows = tl.minimum(cols, INTER - 1)
    e = expert.to(tl.int64)
    w_ptr += e * 2 * INTER * W_STRIDE
    s_ptr += e * 2 * INTER * GROUPS
    z_ptr += e * 2 * INTER * GROUPS
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    a_total = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = _rows_tile(x_ptr, tokens, valid, k0, K, EVEN_K, BLOCK_K)
        a_sum, a_total = _row_sums(a, a_total, FORMAT, GROUP, HAS_ZERO)
        gate = _dot_step(gate, a, a_sum, w_ptr, s_ptr, z_ptr, rows, k0, K, W_STRIDE, GROUPS, FORMAT, GROUP,
                         HAS_ZERO, EVEN_K, FAST_ACCUM, PRECISION, BLOCK_K)
        up = _dot_step(up, a, a_sum, w_ptr, s_ptr, z_ptr, rows + INTER, k0, K, W_STRIDE, GROUPS, FORMAT, GROUP,
                       HAS_ZERO, EVEN_K, FAST_ACCUM, PRECISION, BLOCK_K)
    a_scale = a_total
    if FORMAT == _FP8:
        a_scale = tl.load(x_scale_ptr + tokens)
    gate = _scaled(gate, a_total, a_scale, s_ptr, z_ptr, rows, GROUPS, FORMAT, GROUP, HAS_ZERO)
    up = _scaled(up, a_total, a_scale, s_ptr, z_ptr, rows + INTER, GROUPS, FORMAT, GROUP, HAS_ZERO)
    _store_act(gate, up, out, cols, INTER, act_scale_ptr, DTYPE, FP8_ACT)


@triton.jit(do_not_specialize=["ENTRIES", "NUM_M"])
def _down_kernel(act_ptr, act_scale_ptr, sorted_ptr, block_expert_ptr, weights_ptr, w_ptr, s_ptr, z_ptr,
                 partial_ptr, ENTRIES, NUM_M, N, K, W_STRIDE, GROUPS, ACT_SCALE_STRIDE, FORMAT: tl.constexpr,
                 GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, FAST_ACCUM: tl.constexpr, PRECISION: tl.constexpr,
                 EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, PDL: tl.constexpr):
    """partial[entry] (float32, BLOCK_N of N columns) = the entry's routing weight × act[slot] W_down^T by the
    block's expert. FP8 act scales: per slot (ACT_SCALE_STRIDE 1) or one static scale (0)."""
    wait_for_inputs(PDL)
    pid_m, pid_n = _tile_of(tl.program_id(0), NUM_M, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert, slots, entries, valid = _block_rows(sorted_ptr, block_expert_ptr, pid_m, ENTRIES, BLOCK_M)
    if expert < 0:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(cols, N - 1)
    e = expert.to(tl.int64)
    w_ptr += e * N * W_STRIDE
    s_ptr += e * N * GROUPS
    z_ptr += e * N * GROUPS
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    a_total = tl.zeros([BLOCK_M], tl.float32)
    every = slots >= 0
    for k0 in range(0, K, BLOCK_K):
        a = _rows_tile(act_ptr, slots, every, k0, K, EVEN_K, BLOCK_K)
        a_sum, a_total = _row_sums(a, a_total, FORMAT, GROUP, HAS_ZERO)
        acc = _dot_step(acc, a, a_sum, w_ptr, s_ptr, z_ptr, rows, k0, K, W_STRIDE, GROUPS, FORMAT, GROUP,
                        HAS_ZERO, EVEN_K, FAST_ACCUM, PRECISION, BLOCK_K)
    a_scale = a_total
    if FORMAT == _FP8:
        a_scale = tl.load(act_scale_ptr + slots * ACT_SCALE_STRIDE)
    acc = _scaled(acc, a_total, a_scale, s_ptr, z_ptr, rows, GROUPS, FORMAT, GROUP, HAS_ZERO)
    _store_partials(acc, entries, valid, cols, N, weights_ptr, partial_ptr)


@triton.jit(do_not_specialize=["T"])
def _sum_top_k_kernel(partial_ptr, ids_ptr, out_ptr, T, N, FIRST, EXPERTS, TOP_K: tl.constexpr,
                      BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[token] = Σ over its TOP_K entries routed to a local expert of partial[entry], in out's dtype."""
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    total = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        local = tl.load(ids_ptr + token * TOP_K + j) - FIRST
        mine = (local >= 0) & (local < EXPERTS)
        total += tl.load(partial_ptr + (token * TOP_K + j) * N + cols, mask=ok & mine, other=0.0)
    tl.store(out_ptr + token * N + cols, total.to(out_ptr.dtype.element_ty), mask=ok)


# --- launchers --------------------------------------------------------------------------------------------------
def _tile(tile: MoeTile, w: ExpertWeights, block_m: int, a_bytes: int, halves: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, stages) of `tile` for this projection: no wider than its shape needs, a step within one
    int4 group, at least 16 deep (32 for e4m3 dots and for int4's two dots of half a step each), and no more
    operand stages than fit MOE_SHARED_MEMORY and the GPU's shared memory (fewer stages first, then shallower
    steps: float32 activations and weights need four times e4m3's room)."""
    block_n = max(16, min(tile.block_n, triton.next_power_of_2(w.out_features)))
    least = 16 if w.format in (FLOAT, INT8) else 32
    block_k = max(least, min(tile.block_k, triton.next_power_of_2(w.in_features)))
    block_k = min(block_k, w.group) if w.group else block_k
    w_bytes = w.weight.element_size() / (2 if w.format == INT4 else 1)
    stage = lambda k: block_m * k * a_bytes + halves * block_n * k * w_bytes  # noqa: E731
    room = min(MOE_SHARED_MEMORY, shared_memory(w.weight.device) - (3 << 10))  # what the GPU has, less the rest
    stages = tile.num_stages
    while stages > 2 and stages * stage(block_k) > room:
        stages -= 1
    while block_k > least and stages * stage(block_k) > room:
        block_k //= 2
    return block_n, block_k, stages


def _format_args(w: ExpertWeights, block_k: int) -> dict:
    return dict(FORMAT=w.format, GROUP=w.group, HAS_ZERO=w.zero is not None, EVEN_K=w.in_features % block_k == 0)


def _scale_args(w: ExpertWeights, dummy: torch.Tensor) -> tuple:
    """(scale, zero, groups) pointers and count of a projection (the dummy where it has none)."""
    scale = w.scale if w.scale is not None else dummy
    return scale, w.zero if w.zero is not None else scale, scale.shape[2] if w.scale is not None else 1


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def gate_up_act(x: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor, w: ExpertWeights,
                down: ExpertWeights, top_k: int, config: MoeConfig, fast_accumulation: bool,
                launch: dict | None = None):
    """(act (S, I), its FP8 scales or None): SiLU(gate)·up of every sorted slot's token, in the form the down
    projection reads — x's dtype, or e4m3 for FP8 down weights (with the static scale, or per slot)."""
    t, k = x.shape
    inter = w.out_features // 2
    slots = sorted_ids.shape[0]
    x_in, x_scale = quantize_fp8_rows(x, None, w.input_scale, launch) if w.format == FP8 else (x, x)
    static_act = down.format == FP8 and down.input_scale is not None
    act = torch.empty((slots, inter), dtype=torch.float8_e4m3fn if static_act else x.dtype, device=x.device)
    block_n, block_k, stages = _tile(config.gate_up, w, config.block_m, x_in.element_size(), halves=2)
    scale, zero, groups = _scale_args(w, x)
    num_m = slots // config.block_m
    grid = (num_m * triton.cdiv(inter, block_n),)
    _gate_up_kernel[grid](x_in, x_scale, sorted_ids, block_expert, w.weight, scale, zero, act,
                          down.input_scale if static_act else x, t * top_k, num_m, inter, k, w.weight.shape[2],
                          groups, TOP_K=top_k, FP8_ACT=static_act, FAST_ACCUM=fast_accumulation,
                          PRECISION=_precision(x.dtype), DTYPE=TL_DTYPES[x.dtype], BLOCK_M=config.block_m,
                          BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=config.gate_up.group_m,
                          num_warps=config.gate_up.num_warps, num_stages=stages,
                          **_format_args(w, block_k), **launch_args(launch))
    if down.format == FP8 and not static_act:
        return quantize_fp8_rows(act, launch=launch)
    return act, down.input_scale


def down_partials(act: torch.Tensor, act_scale: torch.Tensor | None, sorted_ids: torch.Tensor,
                  block_expert: torch.Tensor, weights: torch.Tensor, w: ExpertWeights, config: MoeConfig,
                  fast_accumulation: bool, dtype: torch.dtype, launch: dict | None = None) -> torch.Tensor:
    """(T·k, H) float32: each routed entry's routing weight times its expert's down projection of act."""
    entries = weights.numel()
    n, k = w.out_features, w.in_features
    partial = torch.empty((entries, n), dtype=torch.float32, device=act.device)
    block_n, block_k, stages = _tile(config.down, w, config.block_m, act.element_size())
    scale, zero, groups = _scale_args(w, weights)
    num_m = sorted_ids.shape[0] // config.block_m
    grid = (num_m * triton.cdiv(n, block_n),)
    per_slot = w.format == FP8 and w.input_scale is None
    _down_kernel[grid](act, weights if act_scale is None else act_scale, sorted_ids, block_expert, weights,
                       w.weight, scale, zero, partial, entries, num_m, n, k, w.weight.shape[2], groups,
                       1 if per_slot else 0, FAST_ACCUM=fast_accumulation, PRECISION=_precision(dtype),
                       BLOCK_M=config.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=config.down.group_m,
                       num_warps=config.down.num_warps, num_stages=stages,
                       **_format_args(w, block_k), **launch_args(launch))
    return partial


def sum_top_k(partial: torch.Tensor, ids: torch.Tensor, first_expert: int, experts: int,
              dtype: torch.dtype, launch: dict | None = None) -> torch.Tensor:
    t, top_k = ids.shape
    n = partial.shape[1]
    out = torch.empty((t, n), dtype=dtype, device=partial.device)
    block = min(1024, triton.next_power_of_2(n))
    _sum_top_k_kernel[(t, triton.cdiv(n, block))](partial, ids, out, t, n, first_expert, experts, TOP_K=top_k,
                                                  BLOCK=block, num_warps=4, **launch_args(launch))
    return out


def fused_moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor | dict, down: torch.Tensor | dict,
              top_k: int, renormalize: bool, first_expert: int = 0, algo: str | None = None,
              fast_accumulation: bool = True, config: MoeConfig | None = None,
              launch: dict | None = None, grouped_mm: bool | None = None) -> torch.Tensor:
    """reference.moe on the GPU: x (T, H) routed to top_k of the router's experts, computed by the local experts
    first_expert .. first_expert + E - 1 of gate_up (E, 2I, H) and down (E, H, I), each a float tensor or a dict of
    `algo`'s tensors. fast_accumulation: FP8 dots accumulate as the tensor cores do (else in float32 per step).
    grouped_mm: the experts' products on torch's grouped GEMMs (True), on this module's kernels (False), or as
    tuning.MOE_GROUPED_MM_ROWS chooses for T and the experts' format (None)."""
    gate_up_w, down_w = expert_weights(gate_up, algo), expert_weights(down, algo)
    experts = gate_up_w.weight.shape[0]
    if grouped_mm is None:
        rows = tuning.MOE_GROUPED_MM_ROWS.get("fp8" if gate_up_w.format == FP8 else "bf16")
        per_expert = x.shape[0] * top_k / experts
        grouped_mm = (rows is not None and rows[0] <= per_expert and (rows[1] is None or per_expert < rows[1])
                      and grouped_mm_refusal(x, gate_up_w, down_w) is None)
    elif grouped_mm and (refusal := grouped_mm_refusal(x, gate_up_w, down_w)) is not None:
        raise ValueError(refusal)
    launch = launch_args(launch)
    ids, weights = route(F.linear(x, router), top_k, renormalize, launch)
    if grouped_mm:
        return _grouped_moe(x, ids, weights, gate_up_w, down_w, first_expert, fast_accumulation, launch)
    config = config or moe_config(x.shape[0], top_k, experts, gate_up_w.format)
    if config.tma and tma_refusal(x, gate_up_w, down_w) is None:
        return _tma_moe(x, ids, weights, gate_up_w, down_w, first_expert, config, fast_accumulation, launch)
    groups = align(ids, config.block_m, first_expert, experts, launch)
    act, act_scale = gate_up_act(x, groups.sorted_ids, groups.block_expert, gate_up_w, down_w, top_k, config,
                                 fast_accumulation, launch)
    partial = down_partials(act, act_scale, groups.sorted_ids, groups.block_expert, weights, down_w, config,
                            fast_accumulation, x.dtype, launch)
    return sum_top_k(partial, ids, first_expert, experts, x.dtype, launch)


# --- the experts' products on torch's grouped GEMMs (CUTLASS) -----------------------------------------------------
# The routed rows are gathered in expert order (per-token e4m3 for FP8 experts) into one operand, each expert's
# rows a segment that ends at Alignment.ends; torch._scaled_grouped_mm (FP8, row-wise scales) or torch._grouped_mm
# (bf16) multiplies every segment by its expert; SiLU·up (quantized again for FP8) between the two; the down
# products are summed per token with the routing weights.
GROUPED_BLOCK = 16            # segment padding of the gathered operand (rows)


def grouped_mm_refusal(x: torch.Tensor, gate_up: ExpertWeights, down: ExpertWeights) -> str | None:
    """Why torch's grouped GEMMs cannot run this layer (None: they can): a Hopper GPU, a bfloat16 model, and bf16
    experts or FP8 experts with per-token activations."""
    if not (x.is_cuda and torch.cuda.get_device_capability(x.device) == (9, 0)):
        return "torch's grouped GEMMs run on Hopper GPUs (compute capability 9.0) only"
    if x.dtype != torch.bfloat16:
        return f"torch's grouped GEMMs take a bfloat16 model, not {x.dtype}"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no grouped GEMMs (torch._scaled_grouped_mm)"
    formats = {(w.format, w.input_scale is None) for w in (gate_up, down)}
    if formats not in ({(FLOAT, True)}, {(FP8, True)}):
        return "torch's grouped GEMMs take bf16 experts or FP8 experts with per-token activations"
    return None


@triton.jit(do_not_specialize=["ENTRIES"])
def _gather_rows_kernel(x_ptr, sorted_ptr, out_ptr, scale_ptr, static_ptr, ENTRIES, K, TOP_K: tl.constexpr,
                        FP8_OUT: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row `slot` of the gathered operand: x's row of the slot's token (zeros for padding), in x's dtype or in e4m3
    with its scale (per token, or the STATIC one)."""
    wait_for_inputs(PDL)
    slot = tl.program_id(0).to(tl.int64)
    entry = tl.load(sorted_ptr + slot)
    valid = entry < ENTRIES
    token = tl.where(valid, entry // TOP_K, 0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    row = tl.load(x_ptr + token * K + cols, mask=ok & valid, other=0.0)
    if FP8_OUT:
        row = row.to(tl.float32)
        scale = tl.load(static_ptr) if STATIC else fp8_row_scale(row)
        store_fp8_row(row, scale, ok, out_ptr + slot * K + cols, scale_ptr, slot)
    else:
        tl.store(out_ptr + slot * K + cols, row, mask=ok)


@triton.jit(do_not_specialize=["T"])
def _sum_slots_kernel(rows_ptr, slot_of_ptr, weights_ptr, out_ptr, T, N, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
    """out[token] = Σ over its TOP_K entries with a local slot of routing weight × rows[slot], in out's dtype."""
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    total = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tl.load(slot_of_ptr + token * TOP_K + j).to(tl.int64)
        weight = tl.load(weights_ptr + token * TOP_K + j)
        row = tl.load(rows_ptr + tl.maximum(slot, 0) * N + cols, mask=ok & (slot >= 0), other=0.0)
        total += weight * row.to(tl.float32)
    tl.store(out_ptr + token * N + cols, total.to(out_ptr.dtype.element_ty), mask=ok)


def gather_rows(x: torch.Tensor, groups: Alignment, top_k: int, fp8: bool, static_scale: torch.Tensor | None = None,
                launch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the gathered operand (S, H), its per-row e4m3 scales (S,) or None): FP8 rows quantized per token, or by
    static_scale where given."""
    slots, k = groups.sorted_ids.shape[0], x.shape[1]
    out = torch.empty((slots, k), dtype=torch.float8_e4m3fn if fp8 else x.dtype, device=x.device)
    scale = torch.empty(slots, dtype=torch.float32, device=x.device) if fp8 else None
    block = triton.next_power_of_2(k)
    _gather_rows_kernel[(slots,)](x, groups.sorted_ids, out, out if scale is None else scale,
                                  x if static_scale is None else static_scale, x.shape[0] * top_k, k,
                                  TOP_K=top_k, FP8_OUT=fp8, STATIC=static_scale is not None, BLOCK=block,
                                  num_warps=min(16, max(4, block // 1024)), **launch_args(launch))
    return out, scale


def grouped_products(a: torch.Tensor, a_scale: torch.Tensor | None, w: ExpertWeights, ends: torch.Tensor,
                     fast_accumulation: bool) -> torch.Tensor:
    """(S, N) bfloat16: each segment of a (ending at ends) times its expert's weights (E, N, K), transposed."""
    b = w.weight.transpose(1, 2)
    if w.format == FP8:
        return torch._scaled_grouped_mm(a, b, a_scale, w.scale.reshape(w.scale.shape[:2]), offs=ends,
                                        out_dtype=torch.bfloat16, use_fast_accum=fast_accumulation)
    return torch._grouped_mm(a, b, offs=ends)


def _grouped_moe(x, ids, weights, gate_up: ExpertWeights, down: ExpertWeights, first_expert: int,
                 fast_accumulation: bool, launch: dict) -> torch.Tensor:
    t, top_k = ids.shape
    fp8 = gate_up.format == FP8
    groups = align(ids, GROUPED_BLOCK, first_expert, gate_up.weight.shape[0], launch)
    a, a_scale = gather_rows(x, groups, top_k, fp8, launch=launch)
    gate_up_rows = grouped_products(a, a_scale, gate_up, groups.ends, fast_accumulation)
    if fp8:
        act = silu_and_mul_fp8(gate_up_rows, launch)
        act, act_scale = act.values, act.scale.view(-1)
    else:
        act, act_scale = silu_and_mul(gate_up_rows, launch=launch), None
    down_rows = grouped_products(act, act_scale, down, groups.ends, fast_accumulation)
    out = torch.empty_like(x)
    n = x.shape[1]
    block = min(1024, triton.next_power_of_2(n))
    _sum_slots_kernel[(t, triton.cdiv(n, block))](down_rows, groups.slot_of, weights, out, t, n, TOP_K=top_k,
                                                   BLOCK=block, num_warps=4, **launch_args(launch))
    return out


# --- the experts' products with both operands read by the TMA engine (Hopper) ------------------------------------
# MoeConfig.tma: the routed rows are gathered in expert order first (gather_rows: e4m3 for FP8 experts, per token or
# by the static scale), so that each block's rows, like its expert's weight rows, are one rectangle of a
# contiguous matrix: tensor descriptors load both operands (no per-element addresses), and the same two kernels as
# above otherwise (SiLU·up in gate/up's epilogue, the routing weights in down's).
def tma_refusal(x: torch.Tensor, gate_up: ExpertWeights, down: ExpertWeights) -> str | None:
    """Why the TMA kernels cannot run this layer (None: they can): float or FP8 experts, rows of whole 16-byte
    units, a Hopper (or newer) GPU or Triton's interpreter."""
    if {gate_up.format, down.format} not in ({FLOAT}, {FP8}):
        return "the TMA kernels take float or FP8 experts"
    for w in (gate_up, down):
        if not w.weight.is_contiguous() or (w.in_features * w.weight.element_size()) % 16:
            return "the TMA kernels take contiguous expert weights whose rows are whole 16-byte units"
    if (x.shape[1] * x.element_size()) % 16:
        return "the TMA kernels take rows of whole 16-byte units"
    if TensorDescriptor is None:
        return f"Triton {triton.__version__} has no tensor descriptors"
    if os.environ.get("TRITON_INTERPRET", "0") == "0" and not (
            x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9):
        return "the TMA engine is on Hopper GPUs (compute capability 9.0) and newer"
    return None


@triton.jit
def _tma_dot(acc, a, w, FP8: tl.constexpr, FAST_ACCUM: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a (BLOCK_M, BLOCK_K) · w (BLOCK_N, BLOCK_K)^T; e4m3 without fast accumulation adds each step's dot to
    acc in float32."""
    if FP8 and not FAST_ACCUM:
        return acc + tl.dot(a, w.T)
    return tl.dot(a, w.T, acc, input_precision=PRECISION)


@triton.jit(do_not_specialize=["NUM_M"])
def _gate_up_tma_kernel(a_desc, a_scale_ptr, block_expert_ptr, w_desc, s_ptr, act_ptr, act_scale_ptr, NUM_M, INTER,
                        K, FP8: tl.constexpr, FP8_ACT: tl.constexpr, FAST_ACCUM: tl.constexpr,
                        PRECISION: tl.constexpr, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr):
    """act[slot] (BLOCK_M × BLOCK_N of I columns) = SiLU(gate)·up of the gathered rows a by the block's expert, as
    _gate_up_kernel computes it."""
    wait_for_inputs(PDL)
    pid_m, pid_n = _tile_of(tl.program_id(0), NUM_M, tl.cdiv(INTER, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out = act_ptr + slots[:, None].to(tl.int64) * INTER + cols[None, :]
    if expert < 0:
        tl.store(out, tl.zeros([BLOCK_M, BLOCK_N], act_ptr.dtype.element_ty), mask=(cols < INTER)[None, :])
        return
    first = expert * 2 * INTER + pid_n * BLOCK_N       # the block's gate rows; its up rows INTER further
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([pid_m * BLOCK_M, k0])
        gate = _tma_dot(gate, a, w_desc.load([first, k0]), FP8, FAST_ACCUM, PRECISION)
        up = _tma_dot(up, a, w_desc.load([first + INTER, k0]), FP8, FAST_ACCUM, PRECISION)
    if FP8:
        a_scale = tl.load(a_scale_ptr + slots)[:, None]
        rows = expert.to(tl.int64) * 2 * INTER + tl.minimum(cols, INTER - 1)
        gate = gate * a_scale * tl.load(s_ptr + rows)[None, :]
        up = up * a_scale * tl.load(s_ptr + rows + INTER)[None, :]
    _store_act(gate, up, out, cols, INTER, act_scale_ptr, DTYPE, FP8_ACT)


@triton.jit(do_not_specialize=["ENTRIES", "NUM_M"])
def _down_tma_kernel(a_desc, a_scale_ptr, sorted_ptr, block_expert_ptr, weights_ptr, w_desc, s_ptr, partial_ptr,
                     ENTRIES, NUM_M, N, K, A_SCALE_STRIDE, FP8: tl.constexpr, FAST_ACCUM: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, PDL: tl.constexpr):
    """partial[entry] = the entry's routing weight × act[slot] W_down^T by the block's expert, as _down_kernel."""
    wait_for_inputs(PDL)
    pid_m, pid_n = _tile_of(tl.program_id(0), NUM_M, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert, slots, entries, valid = _block_rows(sorted_ptr, block_expert_ptr, pid_m, ENTRIES, BLOCK_M)
    if expert < 0:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    first = expert * N + pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = _tma_dot(acc, a_desc.load([pid_m * BLOCK_M, k0]), w_desc.load([first, k0]), FP8, FAST_ACCUM,
                       PRECISION)
    if FP8:
        rows = expert.to(tl.int64) * N + tl.minimum(cols, N - 1)
        acc = acc * tl.load(a_scale_ptr + slots * A_SCALE_STRIDE)[:, None] * tl.load(s_ptr + rows)[None, :]
    _store_partials(acc, entries, valid, cols, N, weights_ptr, partial_ptr)


def _descriptor(t: torch.Tensor, block_rows: int, block_k: int):
    """A tensor descriptor of t as a (rows, K) matrix read in (block_rows, block_k) boxes."""
    matrix = t.reshape(-1, t.shape[-1])
    return TensorDescriptor(matrix, list(matrix.shape), list(matrix.stride()), [block_rows, block_k])


def _tma_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: ExpertWeights,
             down: ExpertWeights, first_expert: int, config: MoeConfig, fast_accumulation: bool,
             launch: dict) -> torch.Tensor:
    t, top_k = ids.shape
    experts, fp8 = gate_up.weight.shape[0], gate_up.format == FP8
    groups = align(ids, config.block_m, first_expert, experts, launch)
    a, a_scale = gather_rows(x, groups, top_k, fp8, gate_up.input_scale, launch)
    slots, inter, hidden = a.shape[0], gate_up.out_features // 2, down.out_features
    num_m = slots // config.block_m
    static_act = fp8 and down.input_scale is not None
    act = torch.empty((slots, inter), dtype=torch.float8_e4m3fn if static_act else x.dtype, device=x.device)
    block_n, block_k, stages = _tile(config.gate_up, gate_up, config.block_m, a.element_size(), halves=2)
    common = dict(FAST_ACCUM=fast_accumulation, PRECISION=_precision(x.dtype), BLOCK_M=config.block_m, FP8=fp8)
    _gate_up_tma_kernel[(num_m * triton.cdiv(inter, block_n),)](
        _descriptor(a, config.block_m, block_k), x if a_scale is None else a_scale, groups.block_expert,
        _descriptor(gate_up.weight, block_n, block_k), x if gate_up.scale is None else gate_up.scale, act,
        down.input_scale if static_act else x, num_m, inter, a.shape[1], FP8_ACT=static_act,
        DTYPE=TL_DTYPES[x.dtype], BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=config.gate_up.group_m,
        num_warps=config.gate_up.num_warps, num_stages=stages, **common, **launch_args(launch))
    act_scale = down.input_scale
    if fp8 and not static_act:
        act, act_scale = quantize_fp8_rows(act, launch=launch)
    partial = torch.empty((weights.numel(), hidden), dtype=torch.float32, device=x.device)
    block_n, block_k, stages = _tile(config.down, down, config.block_m, act.element_size())
    _down_tma_kernel[(num_m * triton.cdiv(hidden, block_n),)](
        _descriptor(act, config.block_m, block_k), weights if act_scale is None else act_scale, groups.sorted_ids,
        groups.block_expert, weights, _descriptor(down.weight, block_n, block_k),
        weights if down.scale is None else down.scale, partial, weights.numel(), num_m, hidden, inter,
        1 if fp8 and down.input_scale is None else 0, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=config.down.group_m, num_warps=config.down.num_warps, num_stages=stages, **common,
        **launch_args(launch))
    return sum_top_k(partial, ids, first_expert, experts, x.dtype, launch)
