"""Learned rounding for the per-group int4 modes: AutoRound's idea (Cheng et al., arXiv:2309.05516) on top of GPTQ
or AWQ.

GPTQ and AWQ choose each module's grid and levels against that module's own output error. Learned rounding then
re-chooses, for a whole decoder layer at once, whether each weight rounds up or down, so that the layer's output
comes as close as it can to the float network's own output for the same tokens — which also pulls each layer back
toward the float network where the quantized layers before it drifted away.

Each level is round(p + v): p is the weight's continuous position on its grid (GPTQ: the value it was rounded
from, the earlier columns' errors already added; AWQ: w / scale + zero), held within half a level of the level
chosen, so that v = 0 gives those levels exactly; v ∈ [-½, ½] is trained by signed gradient descent (rounding
passes gradients straight through; the step size falls linearly to zero) on a few calibration sequences at a time.
Every EVAL_EVERY steps the loss on all sequences is measured and the best v so far (v = 0 included) kept, so
tuning never worsens a layer's calibration loss. The grids (scales, zero points) stay as they are.
"""
from __future__ import annotations

import dataclasses

import torch

from kiln.kernels.quant import int4_values

LR = 2e-3           # signed step on v at the start
BATCH = 4           # calibration sequences a step
EVAL_EVERY = 25     # steps between measurements of the loss on every sequence
EVAL_BATCH = 8      # sequences a forward pass while measuring
HALF = 0.499        # positions stay this close to their level: v = 0 keeps the level


@dataclasses.dataclass
class IntGrid:
    """One module's int4 levels (out, in) on its grid (scale, zero: (out, groups)), and the continuous positions
    (out, in) they were rounded from."""
    levels: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    positions: torch.Tensor


class _RoundThrough(torch.autograd.Function):
    """round(x), with the gradient of the identity."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _squared_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out.float() - target.float()) ** 2).sum()


def learn_rounding(runner, layer, grids: dict[str, IntGrid], stream: torch.Tensor, target: torch.Tensor,
                   steps: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """New uint8 levels for the modules of `layer` named in `grids` (e.g. attn.qkv_proj), trained so that the
    layer (runner.forward) maps `stream`, its input on the quantized network, close to `target`."""
    start = {name: g.levels.float() + (g.positions - g.levels.float()).clamp(-HALF, HALF) for name, g in grids.items()}
    offsets = {name: torch.zeros_like(p, requires_grad=True) for name, p in start.items()}
    dtype = {name: layer.get_submodule(name).weight.dtype for name in grids}
    count, elements = len(runner.lengths), target.numel()

    def weights():
        levels = {n: _RoundThrough.apply(start[n] + offsets[n]).clamp(0, 15) for n in grids}
        return {f"{n}.weight": int4_values(q, grids[n].scale, grids[n].zero).to(dtype[n]) for n, q in levels.items()}

    @torch.no_grad()
    def calibration_loss() -> float:
        w = weights()
        chunks = [range(i, min(i + EVAL_BATCH, count)) for i in range(0, count, EVAL_BATCH)]
        return sum(float(_squared_error(runner.forward(layer, stream, c, w), runner.rows(target, c)))
                   for c in chunks) / elements

    best_loss, best = calibration_loss(), {n: v.detach().clone() for n, v in offsets.items()}
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        batch = torch.randperm(count, generator=generator)[:BATCH].tolist()
        wanted = runner.rows(target, batch)
        loss = _squared_error(runner.forward(layer, stream, batch, weights()), wanted) / wanted.numel()
        grads = torch.autograd.grad(loss, list(offsets.values()))
        with torch.no_grad():
            for v, grad in zip(offsets.values(), grads):
                v.sub_(LR * (1 - step / steps) * grad.sign()).clamp_(-0.5, 0.5)
        if (step + 1) % EVAL_EVERY == 0 or step + 1 == steps:
            loss_now = calibration_loss()
            if loss_now < best_loss:
                best_loss, best = loss_now, {n: v.detach().clone() for n, v in offsets.items()}
    return {n: torch.round(start[n] + best[n]).clamp(0, 15).to(torch.uint8) for n in grids}
