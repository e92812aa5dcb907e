"""The batched LoRA products, kiln/kernels/triton/lora.py (compiled on the GPU, `pytest -m gpu`, and under Triton's
interpreter) and reference.lora (the CPU's), against a float64 torch reference: adapters stacked by slot
(kiln/kernels/lora.py) with ranks under the stack's width, several projections side by side in one layer's output
(q|k|v, gate|up), adapters that leave a projection or the whole layer alone, tokens grouped by slot in uneven,
scattered segments, and the base model's tokens untouched. A CUDA graph captured once serves other groupings."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conftest import DEVICE, gpu_cases, interpreted, on_gpu, rel_err
from kiln.kernels import LoraBatch, reference
from kiln.kernels.lora import LoraSlab, LoraStack, rank_width
from kiln.kernels.metadata import sort_by_slot


@dataclass
class Part:
    offset: int
    a: torch.Tensor
    b: torch.Tensor
    scale: float


def adapters(in_features: int, bounds: tuple, slots: int, ranks: list[int], g: torch.Generator) -> dict:
    """Random parts per slot, float64 on the CPU: slot s gives projection p rank ranks[(s + p) % len], leaves
    projection p alone where (s + p) % 4 == 3, and slot 4 (of 5 or more) leaves the layer alone."""
    parts = {}
    for slot in range(slots):
        parts[slot] = [] if slot == 4 else [
            Part(begin, torch.randn(ranks[(slot + p) % len(ranks)], in_features, generator=g, dtype=torch.float64),
                 torch.randn(end - begin, ranks[(slot + p) % len(ranks)], generator=g, dtype=torch.float64) * 0.1,
                 0.5 + 0.25 * slot)
            for p, (begin, end) in enumerate(zip(bounds, bounds[1:])) if (slot + p) % 4 != 3]
    return parts


def stacked(parts: dict, in_features: int, bounds: tuple, max_rank: int, dtype, device) -> LoraStack:
    """The stack of a layer holding `parts` (slot → parts), a view of a LoraSlab beside another layer's (so its
    slots are strided as the engine's are), filled through the slab's flat images."""
    slab = LoraSlab({"before": (8, (0, 16)), "layer": (in_features, bounds), "after": (16, (0, 8, 24))}, len(parts),
                    max_rank, dtype, device)
    for slot, ps in parts.items():
        slab.load(slot, slab.image({"layer": ps} if ps else {}))
    stack = slab.stacks["layer"]
    assert len(parts) == 1 or stack.a.stride(0) == slab.values.stride(0) != stack.a[0].numel()
    return stack


def token_slots(tokens: int, slots: int, g: torch.Generator) -> list[int]:
    """Runs of uneven length under random slots (-1: the base model; the last token always), then a few rows
    swapped so that some slots' tokens are scattered."""
    out = []
    while len(out) < tokens:
        run = int(torch.randint(1, min(40, max(2, tokens // 3)), (1,), generator=g))
        out += [int(torch.randint(-1, slots, (1,), generator=g))] * run
    out = out[:tokens]
    for _ in range(tokens // 5):
        i, j = torch.randint(0, tokens, (2,), generator=g).tolist()
        out[i], out[j] = out[j], out[i]
    out[-1], out[0] = -1, max(out[0], 0)
    return out


def expected(base: torch.Tensor, x: torch.Tensor, parts: dict, slots_of: list[int], dtype) -> torch.Tensor:
    """base + each token's adapter product, in float64 from the parts as the stack holds them (in `dtype`)."""
    out = base.double().clone()
    for row, slot in enumerate(slots_of):
        for p in parts.get(slot, []):
            a, b = p.a.to(dtype).double(), p.b.to(dtype).double()
            out[row, p.offset:p.offset + b.shape[0]] += p.scale * (x[row].double() @ a.T) @ b.T
    return out


def test_rows_sorted_by_slot():
    rows, starts = sort_by_slot([2, -1, 0, 2, 0, -1, 1], 4)
    assert rows == [2, 4, 6, 0, 3] and starts == [0, 2, 3, 5, 5]
    batch = LoraBatch.of([2, -1, 0, 2, 0, -1, 1], 4, torch.device("cpu"))
    assert batch.rows.tolist() == rows and batch.starts.tolist() == starts
    groups = {slot: rows for slot, rows in batch.groups}
    assert groups[0].tolist() == [2, 4] and groups[1] == slice(6, 7) and groups[2].tolist() == [0, 3]
    assert LoraBatch.of([-1, -1], 4, torch.device("cpu")) is None


@pytest.mark.parametrize("tokens, bounds, slots, max_rank, ranks", [(9, (0, 8, 12, 16), 3, 8, [3, 8]),
                                                                    (40, (0, 20, 40), 6, 33, [33, 2, 16])])
def test_reference_products_in_float64(tokens, bounds, slots, max_rank, ranks):
    g = torch.Generator().manual_seed(tokens)
    parts = adapters(12, bounds, slots, ranks, g)
    stack = stacked(parts, 12, bounds, max_rank, torch.float64, "cpu")
    assert stack.rank == rank_width(max_rank) and stack.a.shape == (slots, (len(bounds) - 1) * stack.rank, 12)
    x, base = torch.randn(tokens, 12, generator=g, dtype=torch.float64), torch.randn(tokens, bounds[-1], generator=g,
                                                                                       dtype=torch.float64)
    slots_of = token_slots(tokens, slots, g)
    out = reference.lora(base.clone(), x, LoraBatch.of(slots_of, slots, torch.device("cpu")), stack)
    assert torch.allclose(out, expected(base, x, parts, slots_of, torch.float64), rtol=1e-12, atol=1e-12)
    untouched = [row for row, slot in enumerate(slots_of) if slot < 0 or not parts[slot]]
    assert untouched and torch.equal(out[untouched], base[untouched])


def test_a_slot_cleared_adds_nothing():
    g = torch.Generator().manual_seed(1)
    parts = adapters(16, (0, 16), 2, [4], g)
    slab = LoraSlab({"layer": (16, (0, 16))}, 2, 4, torch.float32, "cpu")
    for slot, ps in parts.items():
        slab.load(slot, slab.image({"layer": ps}))
    slab.load(0, slab.image({}))                         # an adapter with no part on the layer
    stack = slab.stacks["layer"]
    assert not stack.filled(0) and stack.filled(1) and not stack.a[0].any() and not stack.b[0].any()
    x, base = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g)
    assert torch.equal(reference.lora(base.clone(), x, LoraBatch.of([0, 0, -1], 2, torch.device("cpu")), stack), base)
    with pytest.raises(ValueError, match="starts no projection"):
        slab.image({"layer": [Part(3, torch.ones(2, 16), torch.ones(13, 2), 1.0)]})
    with pytest.raises(ValueError, match="does not fit"):
        slab.image({"layer": [Part(0, torch.ones(17, 16), torch.ones(16, 17), 1.0)]})
    with pytest.raises(ValueError, match="has no adapter slots"):
        slab.image({"other": []})


# backend, tokens, in_features, bounds (projections' first rows and the end), slots, max_rank, ranks, dtype
KERNEL_CASES = [
    interpreted(5, 320, (0, 32, 48, 64), 3, 8, [8, 3], torch.float32),        # K split in 3, the last ragged
    interpreted(70, 32, (0, 64), 5, 16, [16, 5], torch.float16),
    *gpu_cases([("cuda", 1, 4096, (0, 4096, 5120, 6144), 1, 16, [16], torch.bfloat16),
                ("cuda", 256, 4096, (0, 4096, 5120, 6144), 8, 16, [16], torch.bfloat16),
                ("cuda", 37, 4096, (0, 14336, 28672), 16, 64, [64, 8, 33], torch.bfloat16),
                ("cuda", 300, 14336, (0, 4096), 4, 8, [8, 1], torch.float16),
                ("cuda", 2000, 576, (0, 576, 768, 960), 5, 32, [32, 17], torch.float32),
                ("cuda", 3, 2048, (0, 2048), 16, 64, [64], torch.bfloat16)],
               default=[("cuda", 1, 4096, (0, 4096, 5120, 6144), 1, 16, [16], torch.bfloat16),
                        ("cuda", 37, 4096, (0, 14336, 28672), 16, 64, [64, 8, 33], torch.bfloat16),
                        ("cuda", 2000, 576, (0, 576, 768, 960), 5, 32, [32, 17], torch.float32)]),
]


@pytest.mark.parametrize("backend, tokens, in_features, bounds, slots, max_rank, ranks, dtype", KERNEL_CASES)
def test_lora_kernels_match_float64(backend, tokens, in_features, bounds, slots, max_rank, ranks, dtype):
    from kiln.kernels.triton import lora

    device = DEVICE[backend]
    g = torch.Generator().manual_seed(tokens + slots)
    parts = adapters(in_features, bounds, slots, ranks, g)
    stack = stacked(parts, in_features, bounds, max_rank, dtype, device)
    assert lora.takes(stack)
    x = torch.randn(tokens, in_features, generator=g).to(dtype)
    base = torch.randn(tokens, bounds[-1], generator=g).to(dtype)
    slots_of = token_slots(tokens, slots, g) if tokens > 1 else [0]
    batch = LoraBatch.of(slots_of, slots, device)
    out = lora.lora(base.clone().to(device), x.to(device), batch, stack).cpu()
    ref = expected(base, x, parts, slots_of, dtype)
    assert rel_err(out - base, ref - base.double()) < (1e-5 if dtype == torch.float32 else 1.5e-2)
    untouched = [row for row, slot in enumerate(slots_of) if slot < 0 or not parts[slot]]
    assert torch.equal(out[untouched], base[untouched])


@pytest.mark.gpu
def test_a_cuda_graph_serves_other_groupings():
    """Captured once over static rows/starts, the products follow whatever grouping is copied in before a replay,
    and adapters installed after the capture."""
    from kiln.kernels.triton import lora

    g = torch.Generator().manual_seed(7)
    tokens, bounds, slots, cuda = 24, (0, 1024, 1280, 1536), 4, torch.device("cuda")
    parts = adapters(1024, bounds, slots, [16, 4], g)
    slab = LoraSlab({"layer": (1024, bounds)}, slots, 16, torch.bfloat16, cuda)
    stack = slab.stacks["layer"]
    x = torch.randn(tokens, 1024, generator=g).bfloat16()
    base = torch.randn(tokens, bounds[-1], generator=g).bfloat16()
    static_x, static_base = x.to(cuda), base.to(cuda)
    rows = torch.zeros(tokens, dtype=torch.int64, device=cuda)
    starts = torch.zeros(slots + 1, dtype=torch.int64, device=cuda)
    batch = LoraBatch(rows, starts)
    work = static_base.clone()
    lora.lora(work, static_x, batch, stack)                      # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora.lora(work, static_x, batch, stack)
    for slot, ps in parts.items():
        slab.load(slot, slab.image({"layer": ps}))
    for seed in range(3):
        slots_of = token_slots(tokens, slots, torch.Generator().manual_seed(seed))
        sorted_rows, run_starts = sort_by_slot(slots_of, slots)
        rows[:len(sorted_rows)] = torch.tensor(sorted_rows)
        starts.copy_(torch.tensor(run_starts))
        work.copy_(static_base)
        graph.replay()
        ref = expected(base, x, parts, slots_of, torch.bfloat16)
        assert rel_err(work.cpu() - base, ref - base.double()) < 1.5e-2, seed
