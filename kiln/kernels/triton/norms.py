"""Row-wise activation kernels: RMSNorm (+ residual add), SiLU(gate)·up, and per-token FP8 quantization of
activations. Each has its pure-torch twin in kiln/kernels/reference.py (the oracle in tests); the FP8 outputs are
quant.Fp8Rows, as reference.py's ops make them."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant import Fp8Rows
from .launch import launch_args, wait_for_inputs


@triton.jit
def fp8_row_scale(y):
    """A float32 row's per-token e4m3 scale: its largest magnitude / 448, as quant.quantize_activations_fp8."""
    return tl.math.div_rn(tl.maximum(tl.max(tl.abs(y), axis=0), 1e-8), 448.0)


@triton.jit
def store_fp8_row(y, scale, ok, q_ptr, scale_ptr, row):
    """A float32 row y as e4m3 values y / scale (rounded division, as torch's) at q_ptr, and its scale."""
    tl.store(q_ptr, tl.clamp(tl.math.div_rn(y, scale), -448.0, 448.0).to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row, scale)


# --- RMSNorm (+ residual add) ----------------------------------------------------------------------------------
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr, n_cols, eps, HAS_RES: tl.constexpr,
                     BLOCK: tl.constexpr, FP8_OUT: tl.constexpr, PDL: tl.constexpr):
    """One row: RMSNorm (of x + residual, the sum written back as the new residual); out in x's dtype, or
    (FP8_OUT) the same values as per-token e4m3 with their scales."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    wait_for_inputs(PDL)
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        tl.store(res_ptr + row * n_cols + cols, x, mask=mask)          # the new residual, in place
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    y = w * (xf * inv).to(x.dtype)
    if FP8_OUT:
        yf = y.to(tl.float32)
        store_fp8_row(yf, fp8_row_scale(yf), mask, out_ptr + row * n_cols + cols, scale_ptr, row)
    else:
        tl.store(out_ptr + row * n_cols + cols, y, mask=mask)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, fp8: bool,
          launch: dict | None):
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=torch.float8_e4m3fn if fp8 else x.dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device) if fp8 else out
    _rms_norm_kernel[(rows,)](x, x if residual is None else residual, weight, out, scale, cols, eps,
                              HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(cols), FP8_OUT=fp8,
                              num_warps=8, **launch_args(launch))
    return Fp8Rows(out, scale, x.dtype) if fp8 else out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, launch: dict | None = None) -> torch.Tensor:
    return _norm(x, None, weight, eps, False, launch)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 launch: dict | None = None):
    """(rms_norm(x + residual), x + residual); the sum is written into `residual`."""
    return _norm(x, residual, weight, eps, False, launch), residual


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, launch: dict | None = None) -> Fp8Rows:
    return _norm(x, None, weight, eps, True, launch)


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     launch: dict | None = None):
    return _norm(x, residual, weight, eps, True, launch), residual


# --- SiLU(gate) * up -----------------------------------------------------------------------------------------
@triton.jit
def silu_mul(gate, up):
    """SiLU(gate)·up in up's dtype, rounded as reference.silu_and_mul (SiLU rounded, then the product)."""
    g = gate.to(tl.float32)
    return (g / (1.0 + tl.exp(-g))).to(up.dtype) * up


@triton.jit
def _gate_and_up(x_ptr, row, cols, mask, n_cols, PAIRED: tl.constexpr):
    """Columns `cols` of a row's gate and up halves; PAIRED: the row alternates gate, up (pair_gate_up_rows)."""
    if PAIRED:
        both = tl.load(x_ptr + row * 2 * n_cols + 2 * cols[:, None] + tl.arange(0, 2)[None, :], mask=mask[:, None],
                       other=0.0)
        return tl.split(both)
    gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0)
    return gate, tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr, PAIRED: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate, up = _gate_and_up(x_ptr, row, cols, mask, n_cols, PAIRED)
    tl.store(out_ptr + row * n_cols + cols, silu_mul(gate, up), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One whole row (its per-token scale needs all of it): SiLU(gate) * up as per-token e4m3."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate, up = _gate_and_up(x_ptr, row, cols, mask, n_cols, False)
    act = silu_mul(gate, up).to(tl.float32)
    store_fp8_row(act, fp8_row_scale(act), mask, q_ptr + row * n_cols + cols, scale_ptr, row)


def silu_and_mul_fp8(x: torch.Tensor, launch: dict | None = None) -> Fp8Rows:
    rows, n = x.shape[0], x.shape[-1] // 2
    q = torch.empty((rows, n), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n)
    _silu_and_mul_fp8_kernel[(rows,)](x, q, scale, n, BLOCK=block, num_warps=min(16, max(4, block // 1024)),
                                      **launch_args(launch))
    return Fp8Rows(q, scale, x.dtype)


def silu_and_mul(x: torch.Tensor, paired: bool = False, launch: dict | None = None) -> torch.Tensor:
    """SiLU(gate)·up of x = [gate | up] per row, or (paired) x's columns alternating gate, up."""
    n = x.shape[-1] // 2
    out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)
    block = 1024
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, n, BLOCK=block, PAIRED=paired, num_warps=4,
                                                               **launch_args(launch))
    return out


# --- FP8 activations -------------------------------------------------------------------------------------------
@triton.jit
def _quantize_fp8_kernel(x_ptr, smoother_ptr, static_ptr, q_ptr, scale_ptr, K,
                         HAS_SMOOTHER: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row: (x / smoother) / scale → e4m3, scale = the row's largest magnitude / 448 (or the static scale)."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    x = tl.load(x_ptr + row * K + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_SMOOTHER:
        x = tl.math.div_rn(x, tl.load(smoother_ptr + cols, mask=ok, other=1.0))
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        scale = fp8_row_scale(x)
    store_fp8_row(x, scale, ok, q_ptr + row * K + cols, scale_ptr, row)


def quantize_fp8_rows(x: torch.Tensor, smoother: torch.Tensor | None = None,
                      static_scale: torch.Tensor | None = None,
                      launch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel for quant.quantize_activations_fp8(x / smoother, static_scale): e4m3 rows and their (M, 1)
    float32 scales (the static scale repeated per row)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    _quantize_fp8_kernel[(m,)](x.contiguous(), x if smoother is None else smoother,
                               x if static_scale is None else static_scale, q, scale, k,
                               HAS_SMOOTHER=smoother is not None, STATIC=static_scale is not None, BLOCK=block,
                               num_warps=min(16, max(4, block // 1024)), **launch_args(launch))
    return q, scale
