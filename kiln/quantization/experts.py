"""What the experts of a mixture-of-experts layer see on calibration tokens: each expert's inputs are the tokens the
float router sends it, and its down projection's inputs are SiLU(gate)·up of those. Calibration records their
largest magnitudes (static FP8 scales, one per projection for all experts); the layer-by-layer quantizers
(sequential.py) take each expert's H = XᵀX of them, an expert that saw no token the identity (round to nearest).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.kernels import reference

PROJECTIONS = ("moe.gate_up_proj", "moe.down_proj")      # engine names of an MoE layer's expert projections


@dataclass
class ExpertInputs:
    """One expert's calibration inputs, float32: x (tokens, H) routed to it, act (tokens, I) its down's inputs."""
    x: torch.Tensor
    act: torch.Tensor

    def of(self, projection: str) -> torch.Tensor:
        return self.x if projection == "moe.gate_up_proj" else self.act


@torch.no_grad()
def routed_inputs(moe, x: torch.Tensor) -> list[ExpertInputs]:
    """Per local expert of a float MoE module (models/llama.py), the inputs its projections see for tokens x."""
    _, chosen = reference.route(x, moe.router.weight, moe.top_k, moe.renormalize)
    inputs = []
    for local in range(moe.gate_up_proj.shape[0]):
        rows = x[(chosen == local + moe.first_expert).any(dim=-1)].float()
        act = reference.silu_and_mul(F.linear(rows, moe.gate_up_proj[local].float()))
        inputs.append(ExpertInputs(rows, act))
    return inputs


def input_peaks(moe, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """{projection: largest |input| per channel over all local experts}, for static activation scales."""
    inputs = routed_inputs(moe, x)
    return {name: torch.stack([_peak(e.of(name), e.of(name).shape[1]) for e in inputs]).amax(dim=0)
            for name in PROJECTIONS}


def _peak(rows: torch.Tensor, width: int) -> torch.Tensor:
    return rows.abs().amax(dim=0) if rows.shape[0] else rows.new_zeros(width)


def hessian(rows: torch.Tensor) -> torch.Tensor:
    """H = XᵀX / tokens of one expert's inputs; the identity where it saw none (GPTQ then rounds to nearest)."""
    if rows.shape[0] == 0:
        return torch.eye(rows.shape[1], device=rows.device)
    return rows.T @ rows / rows.shape[0]
