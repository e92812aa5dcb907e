"""The MoE layer's kernels: the reference (kernels/reference.moe) on quantized experts, and the GPU's fused MoE
(kernels/triton/fused_moe.py) against a float64 oracle, every expert format — under Triton's interpreter on the CPU
(marker `interpreter`: in the process tests/kernels/test_interpreter.py starts; also in a tiny Mixtral) and compiled
on the GPU (`pytest -m gpu`, the sweep `-m gpu_slow`; skipped without one): 1 to 4096 tokens of 8 experts, top-2,
balanced and unbalanced routing, and replays in a CUDA graph."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, INTERPRETING, interpreted, on_gpu, rel_err
from kiln.config import QuantConfig
from kiln.kernels import AttentionMetadata, ReferenceOps, quant, reference
from kiln.models import LlamaForCausalLM

EXPERT_MODES = ["W8A16", "W4A16", "W4A16_GPTQ", "W4A16_AWQ", "FP8", "FP8_PER_CHANNEL_PER_TOKEN"]
WEIGHT_ONLY = [m for m in EXPERT_MODES if not m.startswith("FP8")]
CUDA = torch.device("cuda")


def stacked_experts(algo: str | None, w: torch.Tensor, group: int = 32, input_scale: float | None = None):
    """w (E, out, in) as `algo` stores experts (each expert's format tensors stacked), or w itself for None."""
    if algo is None:
        return w
    from kiln.quantization import round_experts

    out = round_experts(w, QuantConfig(algo, group_size=group))
    if input_scale is not None:
        out["input_scale"] = torch.tensor([input_scale], device=w.device)
    return out


def oracle_moe(x, router, gate_up, down, top_k: int, renormalize: bool, algo: str | None = None,
               first_expert: int = 0) -> torch.Tensor:
    """float64 MoE on the matrices the stored experts stand for, rounded where the kernels round: experts chosen
    from logits in x's dtype, gate and up rounded to x's dtype before SiLU, FP8 activations quantized (per token
    or by the static scale) from x's dtype values."""
    logits = F.linear(x, router)
    _, chosen = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    weights = torch.softmax(logits.double(), dim=-1).gather(1, chosen)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for local in range((gate_up["weight"] if isinstance(gate_up, dict) else gate_up).shape[0]):
        token, slot = (chosen == local + first_expert).nonzero(as_tuple=True)
        gate, up = _oracle_product(x[token], gate_up, local, algo).to(x.dtype).chunk(2, dim=-1)
        act = F.silu(gate.float()).to(x.dtype) * up
        out.index_add_(0, token, weights[token, slot, None] * _oracle_product(act, down, local, algo))
    return out


def _oracle_product(x: torch.Tensor, w, expert: int, algo: str | None) -> torch.Tensor:
    if not isinstance(w, dict):
        return x.double() @ w[expert].double().T
    params = reference.expert_params(w, expert)
    matrix = quant.dequantize_weight(algo, params).double()
    if not algo.startswith("FP8"):
        return x.double() @ matrix.T
    qx, sx = quant.quantize_activations_fp8(x.float(), params.get("input_scale"))
    return (qx.double() @ matrix.T) * sx.double()


# --- the reference with quantized experts --------------------------------------------------------------------
@pytest.mark.parametrize("algo", EXPERT_MODES)
def test_reference_moe_on_quantized_experts(algo):
    """reference.moe on stacked quantized experts is each expert's quant_linear; weight-only modes equal the float
    loop on the dequantized matrices, and every mode stays near the float experts it quantized."""
    g = torch.Generator().manual_seed(0)
    x, router = torch.randn(9, 64, generator=g), torch.randn(4, 64, generator=g)
    gate_up, down = torch.randn(4, 192, 64, generator=g) * 0.1, torch.randn(4, 64, 96, generator=g) * 0.1
    statics = (float(x.abs().max()) / quant.FP8_MAX, 5.0 / quant.FP8_MAX) if algo == "FP8" else (None, None)
    q_gate_up, q_down = stacked_experts(algo, gate_up, input_scale=statics[0]), stacked_experts(algo, down,
                                                                                              input_scale=statics[1])
    out = reference.moe(x, router, q_gate_up, q_down, 2, True, algo=algo)
    assert rel_err(out, oracle_moe(x, router, q_gate_up, q_down, 2, True, algo)) < 1e-5
    assert rel_err(out, reference.moe(x, router, gate_up, down, 2, True)) < (0.3 if "W4A16" in algo else 0.1)
    if algo in WEIGHT_ONLY:
        deq = [torch.stack([quant.dequantize_weight(algo, reference.expert_params(p, e)) for e in range(4)])
               for p in (q_gate_up, q_down)]
        assert torch.allclose(out, reference.moe(x, router, *deq, 2, True), atol=1e-6)



def test_fused_moe_refuses_other_formats():
    pytest.importorskip("triton")
    from kiln.kernels.triton.fused_moe import expert_weights

    with pytest.raises(ValueError, match="MoE experts run float, W8A16, W4A16\\* or FP8\\* weights"):
        expert_weights({"weight": torch.zeros(2, 4, 8), "weight_scale": torch.ones(2, 4)}, "W8A8_SQ_PER_CHANNEL")



# --- the fused kernels ---------------------------------------------------------------------------------------------
def _e4m3_as_the_gpu_rounds() -> None:
    """Triton 3.6's interpreter rounds float32 → e4m3 without carrying into the exponent (125.9 becomes 64, not
    128) and without saturating; the GPU's cvt.rn.satfinite rounds to nearest even and clamps to ±448. Conversions
    to and from e4m3 go through torch's, clamped first."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    torch_dtypes = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
                    tl.float8e4nv: torch.float8_e4m3fn}
    as_bits = {32: torch.int32, 16: torch.int16, 8: torch.uint8}
    convert = interpreter._convert_float

    def converted(data, src, dst, rounding_mode):
        if tl.float8e4nv not in (src, dst) or {src, dst} - set(torch_dtypes):
            return convert(data, src, dst, rounding_mode)
        raw = np.ascontiguousarray(data).view(f"u{src.primitive_bitwidth // 8}").astype(np.int64)
        values = torch.from_numpy(raw).to(as_bits[src.primitive_bitwidth]).view(torch_dtypes[src]).float()
        if dst == tl.float8e4nv:
            values = values.clamp(-quant.FP8_MAX, quant.FP8_MAX)
        out = values.to(torch_dtypes[dst]).view(as_bits[dst.primitive_bitwidth]).numpy()
        return out.view(f"u{dst.primitive_bitwidth // 8}")

    interpreter._convert_float = converted


if INTERPRETING:
    _e4m3_as_the_gpu_rounds()

# (algo, input scales of gate/up and down: None per token, or static) — every expert format
KERNEL_FORMATS = [(None, None), ("W8A16", None), ("W4A16", None), ("W4A16_GPTQ", None), ("W4A16_AWQ", None),
                  ("FP8_PER_CHANNEL_PER_TOKEN", None), ("FP8", (4.0 / quant.FP8_MAX, 8.0 / quant.FP8_MAX))]
# the interpreter's bfloat16 arithmetic works on the raw bits: bfloat16 runs compiled only
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def moe_case(algo, statics, t: int, experts: int, h: int, inter: int, dtype, routing: str = "random",
             device="cpu", seed: int = 0):
    """(x, router, gate_up, down) of a random MoE layer in `algo`'s format. routing 'one': every token's first
    choice is expert 0 and its second expert 1, the other experts get none."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(t, h, generator=g, device=device)
    router = torch.randn(experts, h, generator=g, device=device)
    if routing == "one":
        x = x.abs() + 0.1
        router = torch.full((experts, h), -1.0, device=device)
        router[0], router[1] = 2.0, 1.0
    gate_up = torch.randn(experts, 2 * inter, h, generator=g, device=device) / h ** 0.5
    down = torch.randn(experts, h, inter, generator=g, device=device) / inter ** 0.5
    gate_scale, down_scale = statics or (None, None)
    return (x.to(dtype), router.to(dtype), stacked_experts(algo, gate_up.to(dtype), input_scale=gate_scale),
            stacked_experts(algo, down.to(dtype), input_scale=down_scale))


# backend: (experts, hidden size, intermediate size): 96 or 384 inputs of down: three groups of 32 or 128, no whole
# number of steps or a last step of 64 at 128 a step
MOE_SHAPE = {"interpreter": (4, 64, 96), "cuda": (8, 256, 384)}


def _calls(counts, routings=("random", "one")) -> tuple:
    """(tokens, routing, first expert a rank holds, seed) of each call."""
    return tuple((t, routing, 0, t) for t in counts for routing in routings)


def _fused_moe_cases() -> list:
    """Under the interpreter float32 and float16: one token, more tokens than a block (not a multiple), all to one
    expert (the others none), and a rank holding experts 2-3 of 4 (expert parallel: the other entries add nothing).
    On the GPU bfloat16 over token counts that pick every block size (kernels/triton/tuning.MOE_CONFIGS) for float
    experts and the decode and prefill sizes for the others (the default run: one count of each of those sizes; the
    sweep: the others), and float16 (float32 runs in the tiny Mixtral of tests/models/test_moe.py)."""
    interpreter_calls = ((1, "random", 0, 1), (37, "random", 0, 3), (21, "one", 0, 4), (13, "random", 2, 5))
    cases = [interpreted(algo, statics, dtype, interpreter_calls) for algo, statics in KERNEL_FORMATS
             for dtype in (torch.float32, torch.float16)]
    for algo, statics in KERNEL_FORMATS:
        # rows an expert gets (top-2 of 8): 1-33 tokens ≤ 16 (MOE_CONFIGS' first row), 100 ≤ 48, 256 ≤ 192
        sharp, rest = ((1, 100, 256, 777), (2, 3, 16, 33, 4096)) if algo is None else ((1, 777), (33, 4096))
        cases += [on_gpu(algo, statics, torch.bfloat16, _calls(sharp)),
                  on_gpu(algo, statics, torch.bfloat16, _calls(rest), slow=True)]
    return cases + [on_gpu(algo, None, torch.float16, _calls((1, 300), ("random",)))
                    for algo in (None, "W4A16_AWQ", "FP8_PER_CHANNEL_PER_TOKEN")]


@pytest.mark.parametrize("backend, algo, statics, dtype, calls", _fused_moe_cases())
def test_fused_moe_matches_float64(backend, algo, statics, dtype, calls):
    """Top-2, renormalised; routing 'one': every token to experts 0 and 1, the others none. On the GPU e4m3 dots
    accumulate as the tensor cores do by default (fast accumulation: in float16 2.8e-3 from float64 at one token,
    against 2e-4 for the other formats)."""
    from kiln.kernels.triton.fused_moe import fused_moe

    experts, hidden, inter = MOE_SHAPE[backend]
    fast_fp8 = backend == "cuda" and dtype == torch.float16 and algo is not None and algo.startswith("FP8")
    tolerance = 1e-2 if fast_fp8 else TOLERANCE[dtype]
    for t, routing, first, seed in calls:
        x, router, gate_up, down = moe_case(algo, statics, t, experts, hidden, inter, dtype, routing, DEVICE[backend],
                                            seed)
        if first:
            gate_up, down = (_expert_slice(w, first, 2) for w in (gate_up, down))
        out = fused_moe(x, router, gate_up, down, 2, True, first, algo)
        ref = oracle_moe(x, router, gate_up, down, 2, True, algo, first)
        assert out.dtype == dtype and rel_err(out, ref) < tolerance, (t, routing, first, rel_err(out, ref))

def _expert_slice(w, first: int, count: int):
    if not isinstance(w, dict):
        return w[first:first + count]
    return {k: v if k == "input_scale" else v[first:first + count] for k, v in w.items()}


@pytest.mark.interpreter
def test_interpreted_routing_without_renormalisation_and_top_1():
    from kiln.kernels.triton.fused_moe import fused_moe

    x, router, gate_up, down = moe_case(None, None, 11, 8, 32, 64, torch.float32, seed=7)
    for top_k, renormalize in ((2, False), (1, True), (3, False)):
        out = fused_moe(x, router, gate_up, down, top_k, renormalize)
        assert rel_err(out, oracle_moe(x, router, gate_up, down, top_k, renormalize)) < TOLERANCE[torch.float32]


@pytest.mark.interpreter
@pytest.mark.parametrize("t, block_m, first, local", [(1, 16, 0, 4), (37, 16, 0, 8), (300, 64, 3, 2), (9, 32, 0, 8)])
def test_interpreted_align_groups_entries_by_expert(t, block_m, first, local):
    """Every local entry appears once, in its expert's segment (entries in order), segments start on block
    boundaries in expert order and end at `ends`, padding holds T·k, blocks past the last segment have expert -1,
    slot_of inverts the placement (-1 for the other experts' entries)."""
    from kiln.kernels.triton.fused_moe import align, route

    top_k = 2
    logits = torch.randn(t, 8, generator=torch.Generator().manual_seed(t))
    ids, _ = route(logits, top_k, True)
    sorted_ids, block_expert, ends, slot_of = align(ids, block_m, first, local)
    entries = t * top_k
    assert sorted_ids.numel() >= entries + min(entries, local) * (block_m - 1)
    expected_blocks = []
    for e in range(local):
        mine = [i for i in range(entries) if int(ids.view(-1)[i]) == first + e]
        expected_blocks += [e] * -(-len(mine) // block_m)
        segment = [b * block_m for b, expert in enumerate(block_expert.tolist()) if expert == e]
        slots = sorted_ids[segment[0]:segment[0] + len(segment) * block_m].tolist() if segment else []
        assert slots[:len(mine)] == mine and all(s == entries for s in slots[len(mine):])
        assert int(ends[e]) == len(expected_blocks) * block_m
    used = len(expected_blocks)
    placed = {int(entry): slot for slot, entry in enumerate(sorted_ids.tolist()) if entry < entries}
    assert slot_of.tolist() == [placed.get(entry, -1) for entry in range(entries)]
    assert block_expert.tolist() == expected_blocks + [-1] * (block_expert.numel() - used)


@pytest.mark.interpreter
def test_interpreted_route_matches_torch_topk():
    from kiln.kernels.triton.fused_moe import route

    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(0)).half()
    ids, weights = route(logits, 2, True)
    ref_weights, ref_ids = reference.route(logits.float(), torch.eye(8), 2, True)
    assert torch.equal(ids.long(), ref_ids) and torch.allclose(weights, ref_weights, atol=1e-6)


class FusedMoeOps(ReferenceOps):
    """The reference kernels with the MoE layer fused (the GPU's kernels, here interpreted)."""

    @staticmethod
    def moe(x, router, gate_up, down, top_k, renormalize, first_expert=0, algo=None):
        from kiln.kernels.triton.fused_moe import fused_moe

        return fused_moe(x, router, gate_up, down, top_k, renormalize, first_expert, algo)


def greedy_tokens(model: LlamaForCausalLM, ops, prompts: list[list[int]], new_tokens: int,
                  device="cpu") -> list[list[int]]:
    """Greedy continuations of `prompts`, batched, through the network with `ops` (prefill, then one-token steps
    over a paged cache of 16-token blocks)."""
    config, block = model.config, 16
    per_seq = -(-(max(map(len, prompts)) + new_tokens) // block)
    net = model.network_class.load(config, model.engine_weights(), per_seq * block, device, ops=ops)
    tables = torch.arange(len(prompts) * per_seq, device=device).view(len(prompts), per_seq)
    caches = [torch.zeros((2, tables.numel(), block, config.num_key_value_heads, config.head_dim),
                          dtype=getattr(torch, config.dtype), device=device) for _ in range(config.num_hidden_layers)]
    seqs, cached = [list(p) for p in prompts], [0] * len(prompts)
    t = lambda values: torch.tensor(values, device=device)  # noqa: E731
    for _ in range(new_tokens):
        ids, positions, slots, starts = [], [], [], [0]
        for b, seq in enumerate(seqs):
            span = range(cached[b], len(seq))
            ids += seq[cached[b]:]
            positions += span
            slots += [int(tables[b, i // block]) * block + i % block for i in span]
            starts.append(starts[-1] + len(span))
        lens = [len(s) for s in seqs]
        meta = AttentionMetadata(t(slots), t(starts), t(lens), tables, max(b - a for a, b in zip(starts, starts[1:])),
                                 max(lens), block)
        with torch.inference_mode():
            logits = net.compute_logits(net(t(ids), t(positions), meta, caches)[t(starts[1:]) - 1])
        for b, seq in enumerate(seqs):
            cached[b] = len(seq)
            seq.append(int(logits[b].argmax()))
    return [seq[len(p):] for seq, p in zip(seqs, prompts)]


@pytest.mark.interpreter
@pytest.mark.parametrize("algo", [None, *EXPERT_MODES])
def test_interpreted_fused_moe_in_a_model_gives_the_reference_tokens(tiny_models, algo):
    """A tiny Mixtral (float32) with its experts in each mode: the fused MoE (prefill, then decode steps of two
    sequences) gives the greedy tokens of the reference loop."""
    from kiln.quantization import quantize_model

    hf_dir, _ = tiny_models["mixtral"]
    model = LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True)
    if algo is not None:
        model = quantize_model(model, QuantConfig(algo, group_size=32), calib_size=2, quiet=True,
                               round_to_nearest=algo != "FP8")
    prompts = [list(range(20, 39)), list(range(60, 64))]
    assert greedy_tokens(model, FusedMoeOps(), prompts, 4) == greedy_tokens(model, ReferenceOps(), prompts, 4)


def assert_replays_eagerly(layer, static_x: torch.Tensor, seeds=(1, 2)) -> None:
    """layer (x → out), captured once in a CUDA graph on static_x (compiled before the capture), replayed on fresh
    inputs that route differently: the eager result each time (no host sync, no shape that depends on the routing)."""
    layer(static_x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
    for seed in seeds:
        fresh = torch.randn(static_x.shape, generator=torch.Generator(device="cuda").manual_seed(seed), device=CUDA)
        static_x.copy_(fresh.to(static_x.dtype))
        graph.replay()
        assert torch.equal(static_out, layer(static_x)), seed


@pytest.mark.gpu
@pytest.mark.parametrize("algo, statics", [(None, None), ("W4A16_GPTQ", None), *KERNEL_FORMATS[-2:]])
def test_fused_moe_replays_in_a_cuda_graph(algo, statics):
    """Captured once, replayed on new inputs that route differently: the eager result each time (no host sync,
    no shape that depends on the routing)."""
    from kiln.kernels.triton.fused_moe import fused_moe

    for t in (1, 24):
        x, router, gate_up, down = moe_case(algo, statics, t, *MOE_SHAPE["cuda"], torch.bfloat16, device=CUDA, seed=t)
        assert_replays_eagerly(lambda x: fused_moe(x, router, gate_up, down, 2, True, 0, algo), x.clone(), (1, 2, 3))




# the TMA path (MoeConfig.tma): float and both FP8 modes
TMA_FORMATS = [(None, None), KERNEL_FORMATS[-2], KERNEL_FORMATS[-1]]


def _tma_config(block_m: int):
    from kiln.kernels.triton.tuning import MoeConfig, MoeTile

    tile = MoeTile(64, 64, 4, 2) if INTERPRETING else MoeTile(128, 128, 8, 3, 8)     # interpreter: ragged tiles
    return MoeConfig(block_m, tile, tile, tma=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("algo, statics", TMA_FORMATS)
def test_interpreted_tma_path_matches_float64(monkeypatch, algo, statics):
    """Both operands read through tensor descriptors after the routed rows are gathered in expert order: the float64
    oracle's layer, with blocks past the last segment and a rank holding experts 2-3 of 4."""
    from kiln.kernels.triton import fused_moe as fm

    taken = []
    monkeypatch.setattr(fm, "_tma_moe", lambda *args, run=fm._tma_moe: taken.append(1) or run(*args))
    for t, routing, first, seed in ((1, "random", 0, 1), (37, "random", 0, 3), (21, "one", 0, 4), (13, "random", 2, 5)):
        x, router, gate_up, down = moe_case(algo, statics, t, *MOE_SHAPE["interpreter"], torch.float32, routing,
                                            seed=seed)
        if first:
            gate_up, down = (_expert_slice(w, first, 2) for w in (gate_up, down))
        out = fm.fused_moe(x, router, gate_up, down, 2, True, first, algo, config=_tma_config(16))
        ref = oracle_moe(x, router, gate_up, down, 2, True, algo, first)
        assert rel_err(out, ref) < TOLERANCE[torch.float32], (t, routing, first, rel_err(out, ref))
    assert len(taken) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("algo, statics", TMA_FORMATS)
def test_tma_path_matches_float64_and_replays(algo, statics):
    """The TMA path on the GPU, bfloat16, 64- and 128-row blocks: the float64 oracle's layer from 1 to 4096 tokens,
    balanced and all to two experts; and replayed in a CUDA graph on inputs that route differently."""
    from kiln.kernels.triton.fused_moe import expert_weights, fused_moe, tma_refusal

    x, router, gate_up, down = moe_case(algo, statics, 1, *MOE_SHAPE["cuda"], torch.bfloat16, device=CUDA)
    refusal = tma_refusal(x, expert_weights(gate_up, algo), expert_weights(down, algo))
    if refusal is not None:
        pytest.skip(refusal)
    for block_m in (64, 128):
        config = _tma_config(block_m)
        for t, routing, first, seed in _calls((1, 33, 777, 4096)):
            x, router, gate_up, down = moe_case(algo, statics, t, *MOE_SHAPE["cuda"], torch.bfloat16, routing, CUDA,
                                                seed)
            out = fused_moe(x, router, gate_up, down, 2, True, first, algo, config=config)
            ref = oracle_moe(x, router, gate_up, down, 2, True, algo, first)
            assert rel_err(out, ref) < TOLERANCE[torch.bfloat16], (block_m, t, routing, rel_err(out, ref))
    assert_replays_eagerly(lambda x: fused_moe(x, router, gate_up, down, 2, True, 0, algo, config=config),
                           x[:24].clone())


def test_tma_path_refuses_what_it_cannot_run():
    """Weight-only experts, and tensors off a Hopper GPU outside the interpreter, keep the pointer kernels."""
    pytest.importorskip("triton")
    from kiln.kernels.triton.fused_moe import expert_weights, tma_refusal

    x, _, gate_up, down = moe_case("W8A16", None, 3, 4, 32, 64, torch.float32)
    assert "float or FP8" in tma_refusal(x, expert_weights(gate_up, "W8A16"), expert_weights(down, "W8A16"))
    if not INTERPRETING:
        x, _, gate_up, down = moe_case(None, None, 3, 4, 32, 64, torch.float32)
        assert "Hopper" in tma_refusal(x, expert_weights(gate_up, None), expert_weights(down, None))


def _loop_products(a, a_scale, w, ends, fast_accumulation):
    """grouped_products as a loop over the experts' segments (the stand-in for torch's grouped GEMMs on the CPU)."""
    out = torch.zeros(a.shape[0], w.weight.shape[1], dtype=torch.float32)
    start = 0
    for e, end in enumerate(ends.tolist()):
        rows = a[start:end].float() * (a_scale[start:end, None] if a_scale is not None else 1.0)
        matrix = w.weight[e].float() * (w.scale[e] if w.scale is not None else 1.0)
        out[start:end] = rows @ matrix.T
        start = end
    return out


@pytest.mark.interpreter
@pytest.mark.parametrize("algo", [None, "FP8_PER_CHANNEL_PER_TOKEN"])
def test_interpreted_grouped_mm_path_around_a_loop(monkeypatch, algo):
    """The grouped-GEMM path's own kernels (alignment with segment ends, the gathered and quantized operand, SiLU·up,
    the weighted sum through slot_of) around a loop standing in for torch's grouped GEMMs: the float64 oracle's
    layer, also with a rank holding experts 2-3 of 4."""
    from kiln.kernels.triton import fused_moe as fm

    monkeypatch.setattr(fm, "grouped_mm_refusal", lambda *args: None)
    monkeypatch.setattr(fm, "grouped_products", _loop_products)
    for t, routing, first, seed in ((1, "random", 0, 1), (37, "random", 0, 3), (21, "one", 0, 4), (13, "random", 2, 5)):
        x, router, gate_up, down = moe_case(algo, None, t, *MOE_SHAPE["interpreter"], torch.float32, routing, seed=seed)
        if first:
            gate_up, down = (_expert_slice(w, first, 2) for w in (gate_up, down))
        out = fm.fused_moe(x, router, gate_up, down, 2, True, first, algo, grouped_mm=True)
        ref = oracle_moe(x, router, gate_up, down, 2, True, algo, first)
        assert rel_err(out, ref) < TOLERANCE[torch.float32], (t, routing, first, rel_err(out, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("algo", [None, "FP8_PER_CHANNEL_PER_TOKEN"])
def test_grouped_mm_path_matches_float64_and_replays(algo):
    """torch's grouped GEMMs (CUTLASS) as the experts' products, bfloat16: the float64 oracle's layer from 1 to
    4096 tokens, balanced and all to two experts; and replayed in a CUDA graph on inputs that route differently."""
    from kiln.kernels.triton.fused_moe import expert_weights, fused_moe, grouped_mm_refusal

    x, router, gate_up, down = moe_case(algo, None, 1, *MOE_SHAPE["cuda"], torch.bfloat16, device=CUDA)
    refusal = grouped_mm_refusal(x, expert_weights(gate_up, algo), expert_weights(down, algo))
    if refusal is not None:
        pytest.skip(refusal)
    for t, routing, first, seed in _calls((1, 33, 777, 4096)):
        x, router, gate_up, down = moe_case(algo, None, t, *MOE_SHAPE["cuda"], torch.bfloat16, routing, CUDA, seed)
        out = fused_moe(x, router, gate_up, down, 2, True, first, algo, grouped_mm=True)
        ref = oracle_moe(x, router, gate_up, down, 2, True, algo, first)
        assert rel_err(out, ref) < TOLERANCE[torch.bfloat16], (t, routing, rel_err(out, ref))
    assert_replays_eagerly(lambda x: fused_moe(x, router, gate_up, down, 2, True, 0, algo, grouped_mm=True),
                           x[:24].clone())


def test_grouped_mm_path_refuses_what_it_cannot_run():
    pytest.importorskip("triton")
    from kiln.kernels.triton.fused_moe import expert_weights, fused_moe, grouped_mm_refusal

    x, router, gate_up, down = moe_case("FP8", (0.01, 0.01), 3, 4, 32, 64, torch.float32)
    w = expert_weights(gate_up, "FP8"), expert_weights(down, "FP8")
    assert "Hopper" in grouped_mm_refusal(x, *w)
    with pytest.raises(ValueError, match="Hopper GPUs"):
        fused_moe(x, router, gate_up, down, 2, True, 0, "FP8", grouped_mm=True)


@pytest.mark.parametrize("shared", [232448, 166912, 101376])        # H100/H200, A100, GeForce
def test_expert_tiles_fit_the_gpus_shared_memory(monkeypatch, shared):
    """Every tuned configuration's operand stages, for Mixtral's projections in every expert format, fit the
    shared memory of the GPU they run on (an H100's 227 KB bounds them at MOE_SHARED_MEMORY)."""
    from kiln.kernels.triton import fused_moe, tuning

    monkeypatch.setattr(fused_moe, "shared_memory", lambda device: shared)
    room = min(tuning.MOE_SHARED_MEMORY, shared - (3 << 10))
    formats = {fused_moe.FLOAT: (torch.bfloat16, 1, 2), fused_moe.FP8: (torch.float8_e4m3fn, 1, 1),
               fused_moe.INT8: (torch.int8, 1, 2), fused_moe.INT4: (torch.uint8, 2, 2)}
    for form, (dtype, packed, a_bytes) in formats.items():
        for out, inp, halves in ((2 * 14336, 4096, 2), (4096, 14336, 1)):
            weight = torch.empty(8, out // halves * halves, inp // packed, dtype=dtype, device="meta")
            w = fused_moe.ExpertWeights(form, weight, None, None, 128 if form == fused_moe.INT4 else 0, None)
            for _, config in tuning.MOE_CONFIGS + tuning.MOE_FLOAT_CONFIGS + tuning.MOE_FP8_CONFIGS:
                for tile in (config.gate_up, config.down):
                    block_n, block_k, stages = fused_moe._tile(tile, w, config.block_m, a_bytes, halves)
                    w_bytes = weight.element_size() / packed
                    assert stages * (config.block_m * block_k * a_bytes + halves * block_n * block_k * w_bytes) <= room
