"""Fusions across a decoder layer's modules, wired once after load by `fuse`. The model's forward stays the plain
sequence of norms and projections; where one kernel can do the work of two modules, the modules of this file stand
in for them (at the sites the model names) and hand the kernels what they need.

- Per-token FP8 activations made where they are made: an RMSNorm, or a gated MLP's SiLU, that feeds a layer
  quantizing its input per token (QuantLinear.takes_fp8_rows) hands it e4m3 rows (quant.Fp8Rows): one pass less.
- The residual add and RMSNorm between two quantized layers, folded into their products (one rank, where the ops'
  folds_norm says so: TritonOps with both layers on int4_mma). The layer before the norm (o_proj, down_proj) is not
  computed when called but handed on (PendingProduct); the norm computes it with the add folded in: at one row the
  kernel adds its output to the residual stream in place and returns that sum times the norm's weight with
  per-program sums of squares (ResidualSum), and the norm leaves 1/rms to the layer after it (DeferredNorm), whose
  kernel scales its products by it. Other steps get the product, and the norm runs as usual.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class ResidualSum:
    """x + residual, written into the residual's buffer by the kernel that made x, and each of that kernel's
    programs' sum of squares of its columns: the next RMSNorm's statistics without another pass."""

    residual: torch.Tensor       # (T, hidden): the new residual stream
    sum_squares: torch.Tensor    # (T, programs) float32
    weighted: torch.Tensor       # residual times the next RMSNorm's weight


@dataclass
class DeferredNorm:
    """rms_norm(residual, weight, eps), not yet applied: `weighted` (weight · residual) is its input but for 1/rms,
    which the kernel that reads it takes from the partial sums of squares and applies to its products."""

    residual: torch.Tensor
    sum_squares: torch.Tensor
    weight: torch.Tensor
    eps: float
    weighted: torch.Tensor | None = None   # None: a kernel that reads it applies the norm first

    @property
    def shape(self) -> torch.Size:
        return self.residual.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.residual.dtype


@dataclass(frozen=True)
class NormSite:
    """An RMSNorm of the residual stream (names of modules in the network): `norm`, the linear layer `after` that
    alone reads its output (None: another module, or several), and the linear layer `before` whose output is added
    to the residual stream right before it (None: none, or a collective between)."""

    norm: str
    after: str | None = None
    before: str | None = None


@dataclass(frozen=True)
class SiluSite:
    """A gated MLP: `gate_up` (called with silu=True) feeds `down` alone."""

    gate_up: str
    down: str


@dataclass
class PendingProduct:
    """A quantized layer's output, not computed yet: the FoldedNorm after it computes it."""

    x: torch.Tensor
    layer: nn.Module


class ProductBeforeNorm(nn.Module):
    """Stands in for the quantized layer before a FoldedNorm: hands its input on."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.linear = linear

    def forward(self, x, lora=None):
        """(lora: always None: DecoderForCausalLM.check_lora refuses adapters on a network with this fusion)"""
        return PendingProduct(x, self.linear)


class FoldedNorm(nn.Module):
    """Stands in for an RMSNorm between two quantized layers whose kernels fold it in (the module docstring)."""

    def __init__(self, norm: nn.Module, ops):
        super().__init__()
        self.norm, self.ops = norm, ops

    def forward(self, x, residual=None):
        if isinstance(x, PendingProduct):
            layer = x.layer
            x = self.ops.quant_linear_before_norm(x.x, layer.algo, layer.quant_params(), layer.bias, residual,
                                                  self.norm.weight)
            if isinstance(x, ResidualSum):
                return DeferredNorm(x.residual, x.sum_squares, self.norm.weight, self.norm.eps, x.weighted), x.residual
        return self.norm(x, residual)


class Fp8Norm(nn.Module):
    """Stands in for an RMSNorm feeding a layer with per-token FP8 activations: its output comes quantized."""

    def __init__(self, norm: nn.Module, ops):
        super().__init__()
        self.norm, self.ops = norm, ops

    def forward(self, x, residual=None):
        if residual is None:
            return self.ops.rms_norm_fp8(x, self.norm.weight, self.norm.eps), x
        return self.ops.add_rms_norm_fp8(x, residual, self.norm.weight, self.norm.eps)


class Fp8Silu(nn.Module):
    """Stands in for a gate/up projection feeding a layer with per-token FP8 activations: SiLU(gate)·up comes
    quantized."""

    def __init__(self, linear: nn.Module, ops):
        super().__init__()
        self.linear, self.ops = linear, ops

    def forward(self, x, silu: bool = False, lora=None):
        """(lora: always None: DecoderForCausalLM.check_lora refuses adapters on a network with this fusion)"""
        out = self.linear(x)
        return self.ops.silu_and_mul_fp8(out) if silu else out


def stands_for(module: nn.Module) -> nn.Module:
    """The module that a module of this file stands in for (the module itself when it is none of them)."""
    if isinstance(module, (FoldedNorm, Fp8Norm)):
        return module.norm
    if isinstance(module, (ProductBeforeNorm, Fp8Silu)):
        return module.linear
    return module


def _takes_fp8_rows(module: nn.Module | None) -> bool:
    return bool(getattr(module, "takes_fp8_rows", False))


def _quant_params(module: nn.Module | None) -> dict | None:
    return module.quant_params() if hasattr(module, "quant_params") else None


def fuse(net: nn.Module, ops, sites: list[NormSite | SiluSite]) -> None:
    """Put the modules of this file in place at `sites` where `ops` computes the fusion (after the weights took the
    ops' layout)."""
    modules = {name: net.get_submodule(name) for site in sites for name in vars(site).values() if name}
    for site in sites:
        if isinstance(site, SiluSite):
            if _takes_fp8_rows(modules[site.down]):
                net.set_submodule(site.gate_up, Fp8Silu(modules[site.gate_up], ops))
            continue
        after, before = modules.get(site.after), modules.get(site.before)
        made, read = _quant_params(before), _quant_params(after)
        if _takes_fp8_rows(after):
            net.set_submodule(site.norm, Fp8Norm(modules[site.norm], ops))
        elif made is not None and read is not None and ops.folds_norm(made, read):
            net.set_submodule(site.norm, FoldedNorm(modules[site.norm], ops))
            net.set_submodule(site.before, ProductBeforeNorm(before))
