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
tuning never worsens a layer's calibration loss. The grids are trained alongside (AutoRound tunes its clipping
range, which sets both): each group's scale as scale·e^a and its zero point as zero + d (in levels), a and d by the
same signed steps (the levels' positions stay where GPTQ or AWQ left them).
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
GRID_LR = 2e-3      # signed step at the start on log(scale) and on the zero point (levels); 0: the grids stay


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
                   steps: int, seed: int = 0) -> dict[str, IntGrid]:
    """New grids (uint8 levels, scales, zero points) for the modules of `layer` named in `grids` (e.g.
    attn.qkv_proj), trained so that the layer (runner.forward) maps `stream`, its input on the quantized network,
    close to `target`."""
    start = {name: g.levels.float() + (g.positions - g.levels.float()).clamp(-HALF, HALF) for name, g in grids.items()}
    params = {name: {"offset": torch.zeros_like(p, requires_grad=True),
                     "log_scale": torch.zeros_like(grids[name].scale, requires_grad=True),
                     **({"zero": torch.zeros_like(grids[name].zero, requires_grad=True)}
                        if grids[name].zero is not None else {})} for name, p in start.items()}
    trained = [(v, 0.5 if key == "offset" else None, LR if key == "offset" else GRID_LR)
               for group in params.values() for key, v in group.items() if key == "offset" or GRID_LR > 0]
    dtype = {name: layer.get_submodule(name).weight.dtype for name in grids}
    count, elements = len(runner.lengths), target.numel()

    def tuned(name: str, p: dict) -> IntGrid:
        g = grids[name]
        levels = _RoundThrough.apply(start[name] + p["offset"]).clamp(0, 15)
        zero = g.zero + p["zero"] if g.zero is not None else None
        return IntGrid(levels, g.scale * torch.exp(p["log_scale"]), zero, g.positions)

    def weights() -> dict[str, torch.Tensor]:
        now = {name: tuned(name, p) for name, p in params.items()}
        return {f"{n}.weight": int4_values(g.levels, g.scale, g.zero).to(dtype[n]) for n, g in now.items()}

    @torch.no_grad()
    def calibration_loss() -> float:
        w = weights()
        chunks = [range(i, min(i + EVAL_BATCH, count)) for i in range(0, count, EVAL_BATCH)]
        return sum(float(_squared_error(runner.forward(layer, stream, c, w), runner.rows(target, c)))
                   for c in chunks) / elements

    def snapshot() -> dict:
        return {name: {k: v.detach().clone() for k, v in p.items()} for name, p in params.items()}

    best_loss, best = calibration_loss(), snapshot()
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        batch = torch.randperm(count, generator=generator)[:BATCH].tolist()
        wanted = runner.rows(target, batch)
        loss = _squared_error(runner.forward(layer, stream, batch, weights()), wanted) / wanted.numel()
        grads = torch.autograd.grad(loss, [v for v, _, _ in trained])
        with torch.no_grad():
            for (v, bound, lr), grad in zip(trained, grads):
                v.sub_(lr * (1 - step / steps) * grad.sign())
                if bound is not None:
                    v.clamp_(-bound, bound)
        if (step + 1) % EVAL_EVERY == 0 or step + 1 == steps:
            loss_now = calibration_loss()
            if loss_now < best_loss:
                best_loss, best = loss_now, snapshot()
    with torch.no_grad():
        result = {name: tuned(name, p) for name, p in best.items()}
    return {name: dataclasses.replace(g, levels=g.levels.to(torch.uint8)) for name, g in result.items()}
