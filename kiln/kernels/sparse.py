"""2:4 structured sparsity (at most two nonzeros in every four consecutive inputs of a weight row): checking and
magnitude pruning, and the sparse product — NVIDIA's sparse tensor cores through torch's semi-structured sparse
tensors (cuSPARSELt where torch has it, called with cached plans, else CUTLASS) on GPUs of compute capability 8.0+,
in fp16/bf16; CSR products on the CPU, in float32/float64."""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch.sparse import SparseSemiStructuredTensorCUSPARSELT

from kiln.kernels import cusparselt

GROUP = 4
KEEP = 2


def dense_group(weight: torch.Tensor) -> tuple[int, int] | None:
    """(row, first input) of the first group of four inputs with more than two nonzeros; None when 2:4 sparse."""
    rows, cols = weight.shape[-2:]
    if cols % GROUP:
        return 0, cols - cols % GROUP
    nonzero = (weight.reshape(-1, cols // GROUP, GROUP) != 0).sum(-1)
    bad = (nonzero > KEEP).nonzero()
    if not len(bad):
        return None
    row, group = bad[0].tolist()
    return row % rows, group * GROUP


def prune_2_4(weight: torch.Tensor) -> torch.Tensor:
    """The weight with the two smallest-magnitude values of every four consecutive inputs set to zero."""
    rows, cols = weight.shape[-2:]
    if cols % GROUP:
        raise ValueError(f"2:4 pruning needs the input size to be a multiple of 4, got {cols}")
    groups = weight.reshape(-1, cols // GROUP, GROUP)
    keep = groups.abs().float().topk(KEEP, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return (groups * mask).reshape(weight.shape)


def check_2_4(weight: torch.Tensor, name: str) -> None:
    """Refuse a weight that is not 2:4 sparse, naming it and its first dense group."""
    where = dense_group(weight)
    if where is not None:
        raise ValueError(f"{name} is not 2:4 sparse (row {where[0]}, inputs {where[1]}..{where[1] + 3} hold more "
                         "than two nonzeros): prune the checkpoint with kiln convert --prune_2_4, or build without "
                         "weight_sparsity")


def sparse_weight(weight: torch.Tensor, name: str) -> torch.Tensor:
    """`weight` (2:4 sparse, checked) in the representation whose products skip its zeros on its device."""
    check_2_4(weight, name)
    if weight.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(weight.device)
        if major < 8:
            raise ValueError(f"weight_sparsity needs sparse tensor cores (compute capability 8.0+); "
                             f"{torch.cuda.get_device_name(weight.device)} is {major}.{minor}")
        if weight.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"weight_sparsity on a GPU takes float16/bfloat16 weights; {name} is {weight.dtype}")
        from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured

        cusparselt = _has_cusparselt()
        if major >= 9 and not cusparselt:
            raise ValueError("weight_sparsity on this GPU needs cuSPARSELt (torch's CUTLASS sparse kernels run on "
                             "compute capability 8.x only), and this torch has none")
        SparseSemiStructuredTensor._FORCE_CUTLASS = not cusparselt
        try:
            return to_sparse_semi_structured(weight.contiguous())
        except (RuntimeError, ValueError) as err:
            raise ValueError(f"{name} {tuple(weight.shape)} cannot take the sparse tensor cores' layout: {err}") from None
    if weight.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"weight_sparsity on the CPU takes float32/float64 weights (torch's sparse CPU products); "
                         f"{name} is {weight.dtype}: build a float32 engine to run it here")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return weight.to_sparse_csr()


def _has_cusparselt() -> bool:
    try:
        return bool(torch.backends.cusparselt.is_available())
    except AttributeError:
        return False


def sparse_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b for a weight of sparse_weight: cuSPARSELt with cached plans (kiln.kernels.cusparselt) where torch
    compressed the weight for it and the operands are bfloat16, else torch's semi-structured product; CSR products
    on the CPU run as W x^T (torch's sparse linear refuses tensors made under inference mode)."""
    if weight.layout != torch.sparse_csr:
        if (isinstance(weight, SparseSemiStructuredTensorCUSPARSELT) and x.dtype in cusparselt.DATA_TYPES
                and cusparselt.library() is not None):
            out = cusparselt.sparse_mm(weight.packed, weight.shape[0], x.reshape(-1, x.shape[-1]))
            out = out if bias is None else out.add_(bias)
            return out.reshape(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias).contiguous()   # the product comes transposed; kernels want rows
    flat = x.reshape(-1, x.shape[-1]).T
    out = torch.sparse.mm(weight, flat) if bias is None else torch.addmm(bias[:, None], weight, flat)
    return out.T.contiguous().reshape(*x.shape[:-1], weight.shape[0])
