"""The GPU's kernels for quantized layers (kernels/triton/quant_linear.py, gemv.py, weight_only.py) against the
reference formats and products of kiln.kernels.quant: under Triton's interpreter on the CPU (test_interpreted_*, in a
process of their own with TRITON_INTERPRET=1, which must be set before Triton is imported: tests/quantization/
test_quantization.py starts it; collected otherwise, they skip), their layouts on the CPU, and compiled on the GPU
(`pytest -m gpu`, skipped without one)."""
from __future__ import annotations

import os

import pytest
import torch

from conftest import rel_err
from kiln.kernels import quant

pytest.importorskip("triton")
from kiln.kernels import TritonOptions  # noqa: E402
from kiln.kernels.triton import argmax, decode_attention, gemv, norms  # noqa: E402
from kiln.kernels.triton.quant_linear import FP16_ZERO_LIMIT, Interleaved, QuantProducts  # noqa: E402

interpreted_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="runs in its own process with TRITON_INTERPRET=1 (test_quantization.py)")


def _params(algo: str, w: torch.Tensor, group: int = 32) -> dict:
    if algo == "W8A16":
        q, s = quant.quantize_int8(w)
        return {"weight": q, "weight_scale": s}
    packed, s, z = quant.quantize_int4(w, group if algo != "W4A16" else None, algo == "W4A16_AWQ")
    return {"weight": packed, "weight_scale": s, **({"weight_zero": z} if z is not None else {})}


def _rel(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("algo", ["W8A16", "W4A16", "W4A16_GPTQ", "W4A16_AWQ"])
def test_interleaved_layout_is_a_permutation_within_blocks(gemv_products, algo):
    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(1))
    params = _params(algo, w)
    bits = 8 if algo == "W8A16" else 4
    layout, packed = gemv_products.pack(algo, params)
    assert isinstance(layout, Interleaved) and not layout.paired_rows
    assert packed["weight"].shape == params["weight"].shape
    assert torch.equal(gemv.interleave_weight(packed["weight"], bits, inverse=True), params["weight"])
    values = quant.unpack_int4(packed["weight"]) if bits == 4 else packed["weight"]
    word = values.reshape(6, -1, 4, 32 // bits)[0, 0]                     # block 0 of row 0: [word i][value j]
    original = quant.unpack_int4(params["weight"]) if bits == 4 else params["weight"]
    assert torch.equal(word, original[0, :word.numel()].reshape(32 // bits, 4).t())   # word i, value j = column 4j + i
    assert gemv_products.pack(algo, _params(algo, torch.randn(6, 40))) is None   # 40 columns: no whole blocks


@interpreted_only
@pytest.mark.parametrize("algo", ["W8A16", "W4A16", "W4A16_GPTQ", "W4A16_AWQ"])
@pytest.mark.parametrize("n, k, config", [(16, 256, (8, 32, True)), (20, 576, (8, 32, False)), (8, 2048, (4, 64, True))])
def test_interpreted_gemv_matches_the_reference(gemv_products, algo, n, k, config):
    """float32 x, so the comparison sees the kernel's arithmetic (exact products, float32 sums), not bf16 rounding;
    576 columns: a short last group of 64 and an uneven count of blocks; 20 rows: a partial program."""
    g = torch.Generator().manual_seed(n + k)
    params = _params(algo, torch.randn(n, k, generator=g), group=128 if algo == "W4A16_AWQ" else 64)
    bits = 8 if algo == "W8A16" else 4
    weight = gemv_products.pack(algo, params)[1]["weight"]
    for rows in (1, 2, 3, 4):
        x = torch.rand(rows, k, generator=g) * 2 - 0.5                     # a mean away from 0, as activations have
        ref = quant.quant_linear(x.double(), algo, {key: v.double() if v.is_floating_point() else v
                                                    for key, v in params.items()}, None)
        out = gemv.weight_only_gemv(x, weight, params["weight_scale"], params.get("weight_zero"), bits, config)
        assert _rel(out, ref) < 1e-5, (rows, _rel(out, ref))


@interpreted_only
@pytest.mark.parametrize("algo", ["W8A16", "W4A16_AWQ"])
@pytest.mark.parametrize("half", [False, True])
def test_interpreted_tiled_matmul_reads_both_layouts(gemv_products, algo, half):
    """Both layouts, with int4 scales and zero points as float32 (scales below fp16's normal range keep them so) or
    as fp16 pairs."""
    g = torch.Generator().manual_seed(3)
    params = _params(algo, torch.randn(24, 128, generator=g) * (1.0 if half else 1e-6))
    x = torch.randn(5, 128, generator=g)
    layout, packed = gemv_products.pack(algo, params)
    assert layout.half_scales == (half and algo != "W8A16")
    for interleaved, p in ((False, params), (True, {**params, **packed, "layout": layout})):
        ref = quant.quant_linear(x.double(), algo, _stood_for(layout if interleaved else None, params), None)
        assert _rel(gemv_products.linear(x, algo, p, None), ref) < 1e-5, interleaved


@interpreted_only
def test_interpreted_fp8_activation_quantization():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 300, generator=g) * 3
    smoother = torch.rand(300, generator=g) + 0.5
    for static in (None, (x / smoother).abs().max().reshape(1) / quant.FP8_MAX):
        q, scale = norms.quantize_fp8_rows(x, smoother, static)
        ref_q, ref_scale = quant.quantize_activations_fp8(x / smoother, static)
        assert scale.shape == (6, 1) and torch.allclose(scale, ref_scale.expand(6, 1), rtol=1e-6)
        # the interpreter's e4m3 cast can drop the carry when it rounds up to a power of two (the GPU's does not)
        q, ref_q = q.float(), ref_q.float()
        assert torch.all((q == ref_q) | ((torch.frexp(ref_q)[0].abs() == 0.5) & (q == ref_q / 2)))


@interpreted_only
def test_interpreted_norm_and_silu_with_fp8_output():
    """The RMSNorm (with and without the residual) and SiLU kernels' per-token e4m3 output: the same values and scales
    as the reference ops (quant.Fp8Rows.of the unfused output); the residual sum as the unfused kernel's."""
    from kiln.kernels import ReferenceOps

    g = torch.Generator().manual_seed(5)
    x, res, w = torch.randn(5, 96, generator=g) * 2, torch.randn(5, 96, generator=g), torch.rand(96, generator=g) + .5
    gate_up = torch.randn(5, 2 * 80, generator=g) * 3
    cases = [(norms.rms_norm_fp8(x, w, 1e-5), ReferenceOps.rms_norm_fp8(x, w, 1e-5)),
             (norms.silu_and_mul_fp8(gate_up), ReferenceOps.silu_and_mul_fp8(gate_up))]
    fused, fused_res = norms.add_rms_norm_fp8(x, res.clone(), w, 1e-5)
    ref, ref_res = ReferenceOps.add_rms_norm_fp8(x, res, w, 1e-5)
    assert torch.allclose(fused_res, ref_res)
    for out, expected in cases + [(fused, ref)]:
        assert out.dtype == expected.dtype == torch.float32 and out.shape == expected.shape
        assert torch.allclose(out.scale, expected.scale, rtol=1e-5)
        q, ref_q = out.values.float(), expected.values.float()
        carry_dropped = (torch.frexp(ref_q)[0].abs() == 0.5) & (q == ref_q / 2)     # the interpreter's e4m3 cast
        one_step = (q - ref_q).abs() <= ref_q.abs() / 8 + 2 ** -9                  # exp's last bits may differ
        assert (q == ref_q).float().mean() > 0.95 and (one_step | carry_dropped).all()


def _reference_params(params: dict) -> dict:
    return {key: v.double() if v.is_floating_point() else v for key, v in params.items()}


def _stood_for(layout, params: dict) -> dict:
    """float64 parameters of the grid a GPU layout stands for: the engine's, fp16-rounded where it keeps half
    scales."""
    return _reference_params(_fp16_rounded(params) if layout is not None and layout.half_scales else params)


@pytest.mark.parametrize("algo", ["W8A16", "W4A16_AWQ"])
def test_gate_up_rows_are_paired_at_load(gemv_products, algo):
    """A gate/up projection's rows alternate gate, up in the GPU layout (scales and zero points with them); a bit
    width the GEMV does not pair (TritonOptions.silu_in_gemv), or an ungated layer, keeps the engine's row order."""
    params = _params(algo, torch.randn(12, 64, generator=torch.Generator().manual_seed(2)))
    plain = gemv_products.pack(algo, params)[1]
    layout, paired = gemv_products.pack(algo, params, gated=True)
    assert layout.paired_rows and not gemv_products.pack(algo, params)[0].paired_rows
    for name, t in paired.items():
        assert t is plain[name] is None or torch.equal(gemv.pair_gate_up_rows(t, inverse=True), plain[name])
    assert torch.equal(paired["weight"][1], plain["weight"][6]) and torch.equal(paired["weight"][2], plain["weight"][1])
    unpaired = QuantProducts(TritonOptions(silu_in_gemv=()))
    assert not unpaired.pack(algo, params, gated=True)[0].paired_rows


@interpreted_only
@pytest.mark.parametrize("algo", ["W8A16", "W4A16_GPTQ", "W4A16_AWQ"])
@pytest.mark.parametrize("inter, k, config", [(10, 576, (8, 32, False)), (24, 256, (4, 64, True)), (12, 1536, None)])
def test_interpreted_gemv_writes_silu_of_paired_gate_up(gemv_products, algo, inter, k, config):
    """SiLU(gate)·up from the GEMV on paired rows against the float64 reference (quant_linear, then silu_and_mul) at
    1-4 rows; 2·10 rows: a partial program; 576 columns: a short last group; then the >4-row path (tiled kernel +
    silu_and_mul on the pairs) and a plain call on the paired layout, which must still give [gate | up]."""
    from kiln.kernels import ReferenceOps

    g = torch.Generator().manual_seed(inter + k)
    params = _params(algo, torch.randn(2 * inter, k, generator=g), group=128 if algo == "W4A16_AWQ" else 64)
    layout, packed = gemv_products.pack(algo, params, gated=True)
    gpu = {**params, **packed, "layout": layout}
    bits = 8 if algo == "W8A16" else 4
    for rows in (1, 2, 3, 4, 5):
        x = torch.rand(rows, k, generator=g) * 2 - 0.5
        ref = ReferenceOps.quant_linear_silu(x.double(), algo, _stood_for(layout, params))
        if rows <= 4:
            out = gemv.weight_only_gemv(x, packed["weight"], packed["weight_scale"], packed.get("weight_zero"), bits,
                                        config, silu=True)
            plain = gemv.weight_only_gemv(x, packed["weight"], packed["weight_scale"], packed.get("weight_zero"), bits,
                                          config)
            assert torch.equal(out, norms.silu_and_mul(plain, paired=True))   # rounded the same
        else:
            out = gemv_products.linear_silu(x, algo, gpu, None)
            plain = gemv_products.linear(x, algo, gpu, None)
            assert _rel(plain, quant.quant_linear(x.double(), algo, _stood_for(layout, params), None)) < 1e-5
        assert out.shape == (rows, inter) and _rel(out, ref) < 1e-5, (rows, _rel(out, ref))


@interpreted_only
@pytest.mark.parametrize("algo", ["W8A16", "W4A16_AWQ"])
def test_interpreted_fused_decode_gives_the_reference_tokens(gemv_products, tiny_models, algo, monkeypatch):
    """A tiny quantized Llama on the CPU with its weight-only layers on the GPU's layout and kernels (interpreted):
    decode steps of 1 and 3 rows run the decode GEMV (SiLU(gate)·up on paired rows), prompts the tiled kernel; the
    greedy tokens equal ReferenceOps'. The recorded GEMV calls show the fused path was taken (programs of 16 rows keep
    the interpreter quick)."""
    from kiln import LLM, BuildConfig, SamplingConfig
    from kiln.config import QuantConfig
    from kiln.kernels import ReferenceOps
    from kiln.models import LlamaForCausalLM
    from kiln.quantization import quantize_model
    from kiln.runtime import model_runner

    calls = []

    class RecordedProducts(QuantProducts):
        def decode_gemv(self, x, algo, params, silu=False):
            calls.append(silu)
            return gemv.weight_only_gemv(x, params["weight"], params["weight_scale"], params.get("weight_zero"),
                                         8 if algo == "W8A16" else 4, (16, 32, True), silu, self.launch)

    recorded = RecordedProducts(gemv_products.options)

    class GemvOps(ReferenceOps):
        name = "gemv"
        pack_quant = staticmethod(recorded.pack)
        quant_linear = staticmethod(recorded.linear)
        quant_linear_silu = staticmethod(recorded.linear_silu)

    model = LlamaForCausalLM.from_hugging_face(tiny_models["llama"][0], quiet=True)
    model = quantize_model(model, QuantConfig(quant_algo=algo, group_size=32), calib_size=2, quiet=True,
                           round_to_nearest=True)
    build = BuildConfig(max_batch_size=4, max_input_len=32, max_seq_len=64)
    prompts = [list(range(3, 3 + n)) for n in (1, 9, 20)]
    tokens = {}
    for ops in (ReferenceOps(), GemvOps()):
        monkeypatch.setattr(model_runner, "select_ops", lambda *args, ops=ops: ops)
        with LLM(model, build_config=build, device="cpu", quiet=True) as llm:
            params = SamplingConfig(max_new_tokens=6, end_id=-1)
            tokens[ops.name, "batch"] = [o.token_ids for o in llm.generate(prompts, params)]
            tokens[ops.name, "single"] = llm.generate(prompts[1], params).token_ids
    assert tokens["reference", "batch"] == tokens["gemv", "batch"]
    assert tokens["reference", "single"] == tokens["gemv", "single"]
    assert True in calls and False in calls


def _fp16_rounded(params: dict) -> dict:
    """The layer as its fp16 scale/zero pairs stand for it."""
    return {**params, "weight_scale": params["weight_scale"].half().float(),
            "weight_zero": params["weight_zero"].half().float()}


@interpreted_only
@pytest.mark.parametrize("k", [256, 576])
def test_interpreted_half_scales(gemv_products, k):
    """int4 g128 with zero points in the GPU layout keeps scales and zero points as fp16 pairs (one int32 per
    group): the GEMV (1-4 rows), the tiled kernel (5 rows) and the dequantize kernel compute the product of the
    fp16-rounded grid to float32 accuracy. fp16's rounding, against the float64 product of the engine's float32
    grid, adds 3e-3 for these inputs (mean 0.5: the zero points' rounding, up to 2^-9 of a level for zero points
    of 8-16, is summed coherently over x; 6e-4 for zero-mean x), against int4's own 9% from the float weight: under
    5% of it, ~0.05% once added in quadrature. 576: a short last group."""
    from kiln.kernels.triton import weight_only

    g = torch.Generator().manual_seed(k)
    w = torch.randn(40, k, generator=g) * 0.02
    params = _params("W4A16_AWQ", w, group=128)
    layout, packed = gemv_products.pack("W4A16_AWQ", params)
    assert layout.half_scales and packed["weight_scale"].dtype == torch.int32 and packed["weight_zero"] is None
    assert packed["weight_scale"].shape == params["weight_scale"].shape
    gpu = {**params, **packed, "layout": layout}
    del gpu["weight_zero"]
    exact, rounded = _reference_params(params), _reference_params(_fp16_rounded(params))
    for rows in (1, 2, 3, 4, 5):
        x = torch.rand(rows, k, generator=g) * 2 - 0.5
        out = gemv_products.linear(x, "W4A16_AWQ", gpu, None)
        assert _rel(out, quant.quant_linear(x.double(), "W4A16_AWQ", rounded, None)) < 1e-5, rows
        engine_grid = quant.quant_linear(x.double(), "W4A16_AWQ", exact, None)
        added, int4 = _rel(out, engine_grid), _rel(engine_grid, x.double() @ w.double().t())
        assert added < 0.05 * int4, (rows, added, int4)
    dequantized = weight_only.dequantize(packed["weight"], packed["weight_scale"], None, 4, k, True, torch.float32)
    assert _rel(dequantized, quant.dequantize_weight("W4A16_AWQ", rounded)) < 1e-6
    assert _rel(quant.dequantize_weight("W4A16_AWQ", rounded), quant.dequantize_weight("W4A16_AWQ", exact)) < 1e-3


def test_half_scales_only_where_fp16_holds_them(gemv_products):
    """Scales below fp16's normal range, zero points from FP16_ZERO_LIMIT, symmetric or per-channel int4 and int8
    keep float32."""
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(9))
    params = _params("W4A16_AWQ", w, group=128)
    assert gemv_products.pack("W4A16_AWQ", params)[0].half_scales
    tiny = {**params, "weight_scale": params["weight_scale"] * 1e-4}
    shifted = {**params, "weight_zero": params["weight_zero"] + FP16_ZERO_LIMIT}
    for algo, p in (("W4A16_AWQ", tiny), ("W4A16_AWQ", shifted), ("W4A16_GPTQ", _params("W4A16_GPTQ", w, 128)),
                    ("W4A16", _params("W4A16", w)), ("W8A16", _params("W8A16", w))):
        layout, packed = gemv_products.pack(algo, p)
        assert not layout.half_scales and packed["weight_scale"].dtype == torch.float32, algo


@interpreted_only
def test_interpreted_argmax_rows_is_torchs():
    """The two-kernel argmax of greedy decoding equals torch.argmax: a vocabulary that is not a whole number of
    chunks, the maximum in the short last chunk, ties across and within chunks (the first wins), all -inf, NaN."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, 300, generator=g)
    x[1, 299] = 10.0                                   # in the last, short chunk
    x[2, [70, 5, 200]] = 7.0                           # a tie across chunks: column 5
    x[3, [130, 129]] = 7.0                             # a tie within a chunk: column 129
    x[4] = float("-inf")
    x[5, 150] = float("nan")
    for rows in (x, x.bfloat16(), x[:, :256]):
        assert torch.equal(argmax.argmax_rows(rows.contiguous(), chunk=64), rows.argmax(dim=-1))


@interpreted_only
@pytest.mark.parametrize("group", [128, None])
def test_interpreted_int4_fragment_dequantize(group):
    """The dequantize kernel of int4_mma's layout (products of more than 16 rows): the engine layout's float matrix
    exactly, with zero points per group of 128 or per row."""
    from kiln.kernels.triton import int4_fragments

    g = torch.Generator().manual_seed(10)
    packed, scale, zero = quant.quantize_int4(torch.randn(32, 256, generator=g), group, True)
    out = int4_fragments.dequantize(int4_fragments.pack(packed), int4_fragments.pack_grid(scale, zero), torch.float32)
    assert torch.equal(out, quant.dequantize_int4(packed, scale, zero))


def _decode_case(seqs: list[int], heads: int, kv_heads: int, dim: int, block: int, seed: int):
    """A one-token step of sequences with `seqs` cached tokens each (-1: a CUDA graph's padded row: length 0, slot
    -1) over an fp16 cache (the interpreter has no bf16 arithmetic) of scattered blocks holding random old keys:
    (qkv, positions, cos_sin, cache, meta)."""
    from kiln.kernels import AttentionMetadata
    from kiln.kernels.rotary import rope_cos_sin

    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(c // block + 1 for c in seqs if c >= 0) + 3
    cache = torch.randn((2, num_blocks, block, kv_heads, dim), generator=g).half()
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots = [], []
    for cached in seqs:
        table = [order.pop() for _ in range(cached // block + 1)] if cached >= 0 else []
        tables.append(table)
        slots.append(table[cached // block] * block + cached % block if cached >= 0 else -1)
    width = max(map(len, tables))
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    lens = [c + 1 if c >= 0 else 0 for c in seqs]
    meta = AttentionMetadata(t(slots), t(list(range(len(seqs) + 1))), t(lens),
                             t([tb + [0] * (width - len(tb)) for tb in tables]), 1, max(lens), block)
    qkv = torch.randn((len(seqs), (heads + 2 * kv_heads) * dim), generator=g).half()
    positions = t([max(c, 0) for c in seqs])
    return qkv, positions, rope_cos_sin(1024, dim, 10000.0, None), cache, meta


@interpreted_only
@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 2, 32), (4, 4, 16)])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("window", [None, 40])
def test_interpreted_fused_decode_attention_is_rope_cache_and_attention(heads, kv_heads, dim, split, window):
    """decode_attention (rope + cache write + attention + the last partition's merge, one kernel) against
    ReferenceOps' rope_and_cache then paged_attention: the same output and the same cache, the padded row's slot
    untouched; partitions of 64 keys (one tile) and of 128 (two), keys in several blocks; 9 partitions: merged row
    by row (more than UNROLLED_MERGE)."""
    from kiln.kernels import AttentionMetadata, ReferenceOps

    qkv, positions, cos_sin, cache, meta = _decode_case([0, 70, 130, 200, -1], heads, kv_heads, dim, 16, seed=dim)
    scale = dim ** -0.5
    ref_cache = cache.clone()                            # the reference on the real rows (it has no padded rows)
    real = AttentionMetadata(meta.slot_mapping[:4], meta.query_start_loc[:5], meta.seq_lens[:4],
                             meta.block_tables[:4], 1, meta.max_seq_len, meta.tokens_per_block)
    ref = ReferenceOps.rope_cache_attention(qkv[:4], real, positions[:4], cos_sin, ref_cache, heads, kv_heads, dim,
                                            scale, window)
    for parts, part_tokens in ((4, 64), (2, 128), (9, 64)) if split else ((1, None),):    # 201 keys at most
        out_cache = cache.clone()
        out = decode_attention.decode_attention(qkv, positions, cos_sin, out_cache, meta.slot_mapping,
                                                meta.block_tables, meta.seq_lens, heads, kv_heads, dim, scale, window,
                                                num_parts=parts, part_tokens=part_tokens)
        assert _rel(out[:4], ref) < 1e-2, part_tokens
        assert torch.equal(out_cache, ref_cache)
    assert torch.equal(decode_attention._arrival_counters(qkv.device, 1)[:5 * kv_heads],
                       torch.zeros(5 * kv_heads, dtype=torch.int32))


# --- compiled on the GPU (`pytest -m gpu`, skipped without one) ---------------------------------------------------
CUDA = torch.device("cuda")


def _quantized(algo: str, w: torch.Tensor, group: int = 128) -> dict:
    from kiln.kernels import quant

    if algo == "W8A16" or algo.startswith("W8A8"):
        q, s = quant.quantize_int8(w)
        return {"weight": q, "weight_scale": s}
    if algo.startswith("W4A16"):
        packed, s, z = quant.quantize_int4(w, None if algo == "W4A16" else group, algo == "W4A16_AWQ")
        return {"weight": packed, "weight_scale": s, **({"weight_zero": z} if z is not None else {})}
    q, s = quant.quantize_fp8(w)
    return {"weight": q, "weight_scale": s}


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["W8A16", "W4A16", "W4A16_GPTQ", "W4A16_AWQ", "W8A8_SQ_PER_CHANNEL_PER_TOKEN",
                                  "FP8_PER_CHANNEL_PER_TOKEN"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 64])
def test_quantized_matmul_kernels(algo, rows):
    """quant_linear on the layout the engine loads (weight-only: interleaved, GEMV up to 4 rows, tiles above) and
    on the engine layout itself; 576 columns: a short last group of 64."""
    from kiln.kernels import quant
    from kiln.kernels.triton.quant_linear import QuantProducts

    g = torch.Generator(device="cuda").manual_seed(rows)
    w = torch.randn((1536, 576), generator=g, device=CUDA)
    x = torch.randn((rows, 576), generator=g, device=CUDA).bfloat16()
    params = _quantized(algo, w)
    ref = quant.quant_linear(x.float(), algo, params, None)
    products = QuantProducts()
    packed = products.pack(algo, params)
    layouts = [params] + ([{**params, **packed[1], "layout": packed[0]}] if packed else [])
    for p in layouts:
        assert rel_err(products.linear(x, algo, p, None), ref) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["W8A16", "W4A16", "W4A16_GPTQ", "W4A16_AWQ"])
@pytest.mark.parametrize("n, k", [(4096, 4096), (1000, 14336), (256, 576)])
def test_weight_only_gemv(algo, n, k):
    """The decode GEMV against the float64 product on the same quantized weights, for 1-4 rows and for every
    configuration the engine picks or the suite sweeps; uneven row counts and blocks included. Outputs are poisoned
    first (every element must be written)."""
    from kiln.kernels import TritonOptions, quant
    from kiln.kernels.triton import gemv, tuning
    from kiln.kernels.triton.quant_linear import QuantProducts

    products = QuantProducts(TritonOptions(int4_mma="off"))     # the CUDA-core GEMV's interleaved layout

    g = torch.Generator(device="cuda").manual_seed(n + k)
    params = _quantized(algo, torch.randn((n, k), generator=g, device=CUDA) * 0.05,
                        group=64 if algo == "W4A16_GPTQ" else 128)
    bits = 8 if algo == "W8A16" else 4
    weight = products.pack(algo, params)[1]["weight"]
    dequant = quant.dequantize_weight(algo, params).double()
    configs = {None} | (set(tuning.GEMV_SWEEP) if algo == "W4A16_AWQ" else set())
    for rows in (1, 2, 3, 4):
        x = (torch.rand((rows, k), generator=g, device=CUDA) * 4 - 1).bfloat16()
        ref = x.double() @ dequant.t()
        for config in configs:
            if config is not None and rows > 1:
                continue
            torch.cuda.empty_cache()
            out = gemv.weight_only_gemv(x, weight, params["weight_scale"], params.get("weight_zero"), bits, config)
            assert rel_err(out, ref) < 5e-3, (rows, config, rel_err(out, ref))

def _gpu_layout(products, algo: str, params: dict, gated: bool = False) -> dict:
    layout, packed = products.pack(algo, params, gated)
    return {**params, **packed, "layout": layout}


def _gpu_stood_for(params: dict, gpu: dict) -> dict:
    """float64 parameters of the grid that a GPU layout stands for (fp16-rounded where it keeps half scales)."""
    rounded = {name: params[name].half() for name in ("weight_scale", "weight_zero")} if gpu["layout"].half_scales \
        else {}
    return {k: v.double() if v.is_floating_point() else v for k, v in {**params, **rounded}.items()}



@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["W8A16", "W4A16_AWQ"])
def test_gate_up_gemv_writes_silu(algo, gemv_products):
    """The 8B gate_up on paired rows: the GEMV's SiLU(gate)·up equals the unfused GEMV + silu_and_mul bit for bit
    (1-4 rows) and the float64 reference; above 4 rows the tiled kernel + silu_and_mul reading the pairs."""
    from kiln.kernels import ReferenceOps
    from kiln.kernels.triton.norms import silu_and_mul

    g = torch.Generator(device="cuda").manual_seed(12)
    params = _quantized(algo, torch.randn((28672, 4096), generator=g, device=CUDA) * 0.05)
    paired, plain = _gpu_layout(gemv_products, algo, params, gated=True), _gpu_layout(gemv_products, algo, params)
    assert paired["layout"].paired_rows
    for rows in (1, 2, 3, 4, 5, 64):
        x = (torch.rand((rows, 4096), generator=g, device=CUDA) * 4 - 1).bfloat16()
        fused = gemv_products.linear_silu(x, algo, paired, None)
        unfused = silu_and_mul(gemv_products.linear(x, algo, plain, None))
        if rows <= 4:
            assert torch.equal(fused, unfused), rows
        ref = ReferenceOps.quant_linear_silu(x.double(), algo, _gpu_stood_for(params, paired))
        assert rel_err(fused, ref) < 1e-2 and rel_err(unfused, ref) < 1e-2, rows


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336), (1536, 576)])
def test_half_scale_pairs(n, k, gemv_products):
    """W4A16_AWQ g128 on fp16 (scale, zero point) pairs: half the bytes of the float32 grid; the GEMV (1-4 rows),
    the tiled kernel (7, 64) and dequantize + cuBLAS (1024) against the float64 product of the fp16-rounded grid,
    and the error added to the engine grid's product small beside int4's own. 576 columns: a short last group."""
    from kiln.kernels import quant

    g = torch.Generator(device="cuda").manual_seed(n)
    w = torch.randn((n, k), generator=g, device=CUDA) * 0.05
    params = _quantized("W4A16_AWQ", w)
    half = _gpu_layout(gemv_products, "W4A16_AWQ", params)
    assert half["layout"].half_scales and "weight_zero" not in {k for k, v in half.items() if v is not None}
    assert half["weight_scale"].nbytes * 2 == params["weight_scale"].nbytes + params["weight_zero"].nbytes
    rounded = _gpu_stood_for(params, half)
    exact = {**params, "weight_scale": params["weight_scale"].double(), "weight_zero": params["weight_zero"].double()}
    for rows in (1, 2, 3, 4, 7, 64, 1024):
        x = (torch.rand((rows, k), generator=g, device=CUDA) * 4 - 1).bfloat16()
        out = gemv_products.linear(x, "W4A16_AWQ", {k: v for k, v in half.items() if v is not None}, None)
        engine_grid = quant.quant_linear(x.double(), "W4A16_AWQ", exact, None)
        int4 = rel_err(engine_grid, x.double() @ w.double().t())
        assert rel_err(out, quant.quant_linear(x.double(), "W4A16_AWQ", rounded, None)) < 5e-3, rows
        assert rel_err(out, engine_grid) < 0.1 * int4, (rows, rel_err(out, engine_grid), int4)

