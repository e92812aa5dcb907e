"""Quantized linear layers on the GPU: the layout a weight-only layer gets at load, and which kernel computes each
product (QuantProducts, one per TritonOps, made with its options).

Weight-only int4 layers go to int4_mma's fragment layout where it is faster (tuning.INT4_MMA_SHAPES), the others
(and int8) to the interleaved layout of the CUDA-core decode GEMV (gemv.py), with int4 group scales and zero points
as fp16 pairs where fp16 holds them: 4 bytes a group instead of 8, never slower in three H200 runs (W4A16_AWQ batch
1, the decode_fusions phase of gpu_suite: tuning.py). Products of more rows go to weight_only.py; FP8 layers to one
quantizing kernel and fp8_decode (few rows) or torch._scaled_mm; W8A8 to torch._int_mm.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import quant
from ..fusion import DeferredNorm, ResidualSum
from ..quant import Fp8Rows
from . import fp8_decode, gemv, int4_fragments, int4_mma, norms, tuning, weight_only
from .launch import launch_options
from .tuning import TritonOptions

FP16_ZERO_LIMIT = 64.0     # below it fp16 holds a zero point to 1/64 of a level (int4 rounding itself: ±1/2)


@dataclass(frozen=True)
class Interleaved:
    """The GPU's layout of a weight-only layer, made at load and never stored: columns interleaved within 16-byte
    blocks (gemv.interleave_weight); paired_rows: a gate/up projection's gate and up rows alternate
    (gemv.pair_gate_up_rows), so that each GEMV program holds matching pairs and writes SiLU(gate)·up; half_scales: an
    int4 layer's group scales and zero points as fp16 pairs, one int32 per group in `weight_scale` (no
    `weight_zero`); fragments: an int4 layer in int4_mma's layout (half_scales False; paired_rows: its 16-row blocks
    alternate, int4_fragments.pair_blocks, read by int4_mma.gemv(silu=True))."""
    paired_rows: bool = False
    half_scales: bool = False
    fragments: bool = False


def _weight_only(algo: str) -> bool:
    return algo == "W8A16" or algo.startswith("W4A16")


def _bits(algo: str) -> int:
    """Bits per weight of a weight-only mode."""
    return 8 if algo == "W8A16" else 4


def _layout(params: dict) -> Interleaved:
    layout = params.get("layout")
    return layout if isinstance(layout, Interleaved) else None


def _paired(params: dict) -> bool:
    return _layout(params) is not None and _layout(params).paired_rows


def _fragments(params: dict) -> bool:
    return _layout(params) is not None and _layout(params).fragments


def _fp16_keeps(params: dict) -> bool:
    """Whether fp16 holds an int4 layer's group scales (all within fp16's normal range: 11 significant bits) and
    zero points (|zero| < FP16_ZERO_LIMIT); otherwise the layer keeps float32."""
    scale, zero = params["weight_scale"], params.get("weight_zero")
    if zero is None or scale.dim() < 2 or scale.shape[1] == 1:
        return False                       # symmetric or per channel: nothing worth halving
    fp16 = torch.finfo(torch.float16)
    return bool(((scale >= fp16.tiny) & (scale <= fp16.max)).all() and (zero.abs() < FP16_ZERO_LIMIT).all())


def _unpaired(out: torch.Tensor, params: dict) -> torch.Tensor:
    """A product's columns in the order of a paired layer's stored rows → [gate | up]."""
    run = int4_fragments.ROW_BLOCK if _fragments(params) else 1
    return out.reshape(out.shape[0], -1, 2, run).transpose(1, 2).reshape(out.shape)


def _gemv_takes(x, algo: str, params: dict) -> bool:
    """Whether the decode GEMV computes this product: a weight-only layer in the interleaved layout, ≤ 4 rows."""
    layout = _layout(params)
    return _weight_only(algo) and layout is not None and not layout.fragments and x.shape[0] <= gemv.MAX_ROWS


class QuantProducts:
    """The products of quantized layers on the GPU. decode_gemv, int4_gemv, int4_dequantize and rms_norm are the
    kernels it hands work to (a test may stand in for them in a subclass)."""

    def __init__(self, options: TritonOptions = TritonOptions()):
        self.options = options
        self.launch = launch_options(options.pdl)

    def int4_gemv(self, x, words, grid, silu=False, **fold):
        return int4_mma.gemv(x, words, grid, self.launch, silu=silu, **fold)

    def int4_dequantize(self, words, grid, dtype):
        return int4_fragments.dequantize(words, grid, dtype)

    def rms_norm(self, x, weight, eps):
        return norms.rms_norm(x, weight, eps, self.launch)

    # --- the layout, made once at load ----------------------------------------------------------------------
    def pack(self, algo: str, params: dict, gated: bool = False) -> tuple[Interleaved, dict] | None:
        """The GPU's own layout of a quantized layer's parameters: (layout, replaced tensors), or None where the
        engine layout is used as it is. gated: a gate/up projection without bias, read by linear_silu."""
        if not _weight_only(algo):
            return None
        bits = _bits(algo)
        weight = params["weight"]
        grid = {name: params[name] for name in ("weight_scale", "weight_zero") if name in params}
        if bits == 4 and self._takes_fragments(params):
            paired = gated and weight.shape[0] % (2 * int4_fragments.ROW_BLOCK) == 0
            if paired:
                weight = int4_fragments.pair_blocks(weight)
                grid = {name: t if t is None else int4_fragments.pair_blocks(t) for name, t in grid.items()}
            return Interleaved(paired_rows=paired, fragments=True), {
                "weight": int4_fragments.pack(weight), "weight_zero": None,
                "weight_scale": int4_fragments.pack_grid(grid["weight_scale"], grid.get("weight_zero"))}
        if (weight.shape[1] * 8 // bits) % gemv.block_columns(bits):
            return None                        # the tiled kernel reads the engine layout
        tensors = {"weight": gemv.interleave_weight(weight, bits), **grid}
        paired = gated and bits in self.options.silu_in_gemv
        if paired:
            tensors = {name: gemv.pair_gate_up_rows(t) for name, t in tensors.items()}
        half = bits == 4 and not self.options.refittable and _fp16_keeps(params)
        if half:
            tensors["weight_scale"] = weight_only.half_scale_pairs(tensors["weight_scale"], tensors["weight_zero"])
            tensors["weight_zero"] = None
        return Interleaved(paired_rows=paired, half_scales=half), tensors

    def _takes_fragments(self, params: dict) -> bool:
        weight = params["weight"]
        shape = (weight.shape[0], weight.shape[1] * 2)
        choice = self.options.int4_mma
        return (choice != "off" and int4_mma.available(weight.device)
                and int4_fragments.takes(shape, params["weight_scale"].reshape(weight.shape[0], -1).shape[1])
                and (choice == "all" or self._prefers_mma(shape, weight.device)))

    @staticmethod
    def _prefers_mma(shape: tuple[int, int], device: torch.device) -> bool:
        """Whether an int4 (N, K) layer's decode products run faster on int4_mma than on the CUDA-core GEMV."""
        if shape in tuning.INT4_MMA_SHAPES:
            return tuning.INT4_MMA_SHAPES[shape]
        return int4_mma.few_row_blocks(shape[0], device)

    # --- products -------------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor | Fp8Rows | DeferredNorm, algo: str, params: dict,
               bias: torch.Tensor | None) -> torch.Tensor:
        """x @ dequant(w)^T + bias: weight-only int8/int4 by the decode GEMV (≤ 4 rows), int4_mma or weight_only
        (more rows), FP8 activations quantized by one Triton kernel into torch._scaled_mm (fast accumulation as the
        build chose), torch._int_mm for W8A8 (the reference where a product's shape is below those kernels'
        minimums). x may be a DeferredNorm (int4_mma's layout applies it; otherwise the norm is applied first)."""
        if not _fragments(params):
            x = self._applied(x)
        if _weight_only(algo):
            out = self._weight_only_product(x, algo, params)
            if _paired(params):                              # back to [gate | up]
                out = _unpaired(out, params)
        elif algo.startswith("FP8"):
            if isinstance(x, Fp8Rows):
                qx, sx, dtype = x.values, x.scale, x.dtype
            else:
                qx, sx = norms.quantize_fp8_rows(x, params.get("smoother"), params.get("input_scale"), self.launch)
                dtype = x.dtype
            fast = self.options.fp8_fast_accumulation
            if fp8_decode.takes(qx, params["weight"]):
                out = fp8_decode.fp8_decode_matmul(qx, sx, params["weight"], params["weight_scale"], dtype, fast,
                                                   launch=self.launch)
            else:
                out = torch._scaled_mm(qx, params["weight"].t(), scale_a=sx, scale_b=params["weight_scale"][None, :],
                                       out_dtype=dtype, use_fast_accum=fast)
        elif x.shape[0] > 16 and x.shape[1] % 8 == 0 and params["weight"].shape[0] % 8 == 0:
            qx, sx = quant.quantized_activations(x, algo, params)
            acc = torch._int_mm(qx, params["weight"].t())
            out = (acc.float() * sx * params["weight_scale"][None, :]).to(x.dtype)
        else:
            return quant.quant_linear(x, algo, params, bias)
        return out if bias is None else out + bias

    def linear_silu(self, x, algo: str, params: dict, bias: torch.Tensor | None) -> torch.Tensor:
        """SiLU(gate)·up of a quantized gate/up projection: on paired rows (Interleaved.paired_rows) by the decode
        GEMV itself (≤ 4 rows; int4_mma: ≤ 32) or by silu_and_mul reading the pairs; otherwise linear, then
        silu_and_mul."""
        if not _paired(params):
            return norms.silu_and_mul(self.linear(x, algo, params, bias), launch=self.launch)
        if _fragments(params):
            return self._fragment_product(x, params, silu=True)
        x = self._applied(x)
        if _gemv_takes(x, algo, params):
            return self.decode_gemv(x, algo, params, silu=True)
        return norms.silu_and_mul(self._weight_only_product(x, algo, params), paired=True, launch=self.launch)

    def folds_norm(self, before: dict, after: dict) -> bool:
        """Whether the RMSNorm between two layers (their parameters) may be folded into their products
        (linear_before_norm, then a DeferredNorm): both on int4_mma's layout."""
        return self.options.fold_norms and _fragments(before) and _fragments(after)

    def linear_before_norm(self, x: torch.Tensor, algo: str, params: dict, bias: torch.Tensor | None,
                           residual: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor | ResidualSum:
        """linear of a layer whose output is added to `residual` and RMS-normalized next (weight norm_weight), where
        folds_norm said so: at one row int4_mma adds it in place and a ResidualSum comes back (the sum times
        norm_weight, with per-program sums of squares); otherwise the product alone, for add_rms_norm."""
        if (bias is None and isinstance(x, torch.Tensor) and x.shape[0] == 1 and residual.dtype == x.dtype
                and residual.is_contiguous() and x.dtype in (torch.bfloat16, torch.float16) and _fragments(params)):
            weighted, sums = self.int4_gemv(x, params["weight"], params["weight_scale"], residual=residual,
                                            norm_weight=norm_weight)
            return ResidualSum(residual, sums, weighted)
        return self.linear(x, algo, params, bias)

    def _weight_only_product(self, x: torch.Tensor, algo: str, params: dict) -> torch.Tensor:
        """x @ dequant(w)^T of a weight-only layer, its columns in the order of the stored rows: int4_mma, the
        decode GEMV on the interleaved layout, weight_only for more rows or the engine layout."""
        if _fragments(params):
            return self._fragment_product(x, params)
        if _gemv_takes(x, algo, params):
            return self.decode_gemv(x, algo, params)
        return weight_only.weight_only_matmul(x, params["weight"], params["weight_scale"], params.get("weight_zero"),
                                              _bits(algo), _layout(params) is not None)

    def _fragment_product(self, x, params: dict, silu: bool = False) -> torch.Tensor:
        """x @ dequant(w)^T of an int4 layer in int4_mma's layout: mma.sync for ≤ FRAGMENT_SLICES slices of 16 rows
        of bf16/fp16, otherwise the weight dequantized to x's dtype for cuBLAS. silu (paired blocks): SiLU(gate)·up,
        by int4_mma itself where it multiplies. x may be a DeferredNorm: int4_mma scales its products by 1/rms where
        the product before made the weighted sum, otherwise the norm is applied first."""
        weight, grid = params["weight"], params["weight_scale"]                   # int4_fragments.pack_grid's
        if isinstance(x, DeferredNorm):
            if x.weighted is not None and x.shape[0] == 1:
                return self.int4_gemv(x.weighted, weight, grid, silu=silu, rms_of=(x.sum_squares, x.eps))
            x = self._applied(x)
        rows = x.shape[0]
        if rows <= tuning.FRAGMENT_SLICES * int4_mma.MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16):
            if rows <= int4_mma.MAX_ROWS:
                return self.int4_gemv(x, weight, grid, silu=silu)
            return torch.cat([self.int4_gemv(part, weight, grid, silu=silu) for part in x.split(int4_mma.MAX_ROWS)])
        out = x @ self.int4_dequantize(weight, grid, x.dtype).t()
        return norms.silu_and_mul(_unpaired(out, params), launch=self.launch) if silu else out

    def decode_gemv(self, x, algo: str, params: dict, silu: bool = False) -> torch.Tensor:
        """The CUDA-core decode GEMV on a weight-only layer's interleaved parameters."""
        return gemv.weight_only_gemv(x, params["weight"], params["weight_scale"], params.get("weight_zero"),
                                     _bits(algo), silu=silu, launch=self.launch)

    def _applied(self, x):
        """x with a DeferredNorm applied by the standalone RMSNorm kernel (for products that cannot fold it in)."""
        return self.rms_norm(x.residual, x.weight, x.eps) if isinstance(x, DeferredNorm) else x
