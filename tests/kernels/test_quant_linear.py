"""The GPU's kernels for quantized layers (kernels/triton/quant_linear.py, gemv.py, weight_only.py) against the
reference formats and products of kiln.kernels.quant: their layouts on the CPU, and the kernels under Triton's
interpreter on the CPU (marker `interpreter`: in the process tests/kernels/test_interpreter.py starts) and compiled on
the GPU (`pytest -m gpu`, skipped without one)."""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, gpu_cases, interpreted, on_gpu, rel_err
from kiln.kernels import quant

pytest.importorskip("triton")
from kiln.kernels import ReferenceOps, TritonOptions  # noqa: E402
from kiln.kernels.triton import gemv, norms  # noqa: E402
from kiln.kernels.triton.quant_linear import FP16_ZERO_LIMIT, Interleaved, QuantProducts  # noqa: E402
from kiln.kernels.triton.tuning import GEMV_SWEEP  # noqa: E402

WEIGHT_ONLY = ["W8A16", "W4A16", "W4A16_GPTQ", "W4A16_AWQ"]


def quantized(algo: str, w: torch.Tensor, group: int) -> dict:
    """A layer's tensors as `algo` stores them (int4: groups of `group` columns, but per channel for W4A16)."""
    if algo == "W8A16" or algo.startswith("W8A8"):
        q, s = quant.quantize_int8(w)
        return {"weight": q, "weight_scale": s}
    if algo.startswith("W4A16"):
        packed, s, z = quant.quantize_int4(w, None if algo == "W4A16" else group, algo == "W4A16_AWQ")
        return {"weight": packed, "weight_scale": s, **({"weight_zero": z} if z is not None else {})}
    q, s = quant.quantize_fp8(w)
    return {"weight": q, "weight_scale": s}


def gpu_layout(products: QuantProducts, algo: str, params: dict, gated: bool = False) -> dict:
    """The layer's parameters as the GPU's products load them (the layout and its tensors over the engine's)."""
    layout, packed = products.pack(algo, params, gated)
    return {**params, **packed, "layout": layout}


def _float64(params: dict) -> dict:
    return {key: v.double() if v.is_floating_point() else v for key, v in params.items()}


def _fp16_rounded(params: dict) -> dict:
    """The layer as its fp16 scale/zero pairs stand for it."""
    return {**params, "weight_scale": params["weight_scale"].half().float(),
            "weight_zero": params["weight_zero"].half().float()}


def stood_for(layout, params: dict) -> dict:
    """float64 parameters of the grid a GPU layout stands for: the engine's, fp16-rounded where it keeps half
    scales."""
    return _float64(_fp16_rounded(params) if layout is not None and layout.half_scales else params)


# --- layouts (no kernel runs) ------------------------------------------------------------------------------------
@pytest.mark.parametrize("algo", WEIGHT_ONLY)
def test_interleaved_layout_is_a_permutation_within_blocks(gemv_products, algo):
    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(1))
    params = quantized(algo, w, 32)
    bits = 8 if algo == "W8A16" else 4
    layout, packed = gemv_products.pack(algo, params)
    assert isinstance(layout, Interleaved) and not layout.paired_rows
    assert packed["weight"].shape == params["weight"].shape
    assert torch.equal(gemv.interleave_weight(packed["weight"], bits, inverse=True), params["weight"])
    values = quant.unpack_int4(packed["weight"]) if bits == 4 else packed["weight"]
    word = values.reshape(6, -1, 4, 32 // bits)[0, 0]                     # block 0 of row 0: [word i][value j]
    original = quant.unpack_int4(params["weight"]) if bits == 4 else params["weight"]
    assert torch.equal(word, original[0, :word.numel()].reshape(32 // bits, 4).t())   # word i, value j = column 4j + i
    assert gemv_products.pack(algo, quantized(algo, torch.randn(6, 40), 32)) is None   # 40 columns: no whole blocks


@pytest.mark.parametrize("algo", ["W8A16", "W4A16_AWQ"])
def test_gate_up_rows_are_paired_at_load(gemv_products, algo):
    """A gate/up projection's rows alternate gate, up in the GPU layout (scales and zero points with them); a bit
    width the GEMV does not pair (TritonOptions.silu_in_gemv), or an ungated layer, keeps the engine's row order."""
    params = quantized(algo, torch.randn(12, 64, generator=torch.Generator().manual_seed(2)), 32)
    plain = gemv_products.pack(algo, params)[1]
    layout, paired = gemv_products.pack(algo, params, gated=True)
    assert layout.paired_rows and not gemv_products.pack(algo, params)[0].paired_rows
    for name, t in paired.items():
        assert t is plain[name] is None or torch.equal(gemv.pair_gate_up_rows(t, inverse=True), plain[name])
    assert torch.equal(paired["weight"][1], plain["weight"][6]) and torch.equal(paired["weight"][2], plain["weight"][1])
    unpaired = QuantProducts(TritonOptions(silu_in_gemv=()))
    assert not unpaired.pack(algo, params, gated=True)[0].paired_rows


def test_half_scales_only_where_fp16_holds_them(gemv_products):
    """Scales below fp16's normal range, zero points from FP16_ZERO_LIMIT, symmetric or per-channel int4 and int8
    keep float32."""
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(9))
    params = quantized("W4A16_AWQ", w, 128)
    assert gemv_products.pack("W4A16_AWQ", params)[0].half_scales
    tiny = {**params, "weight_scale": params["weight_scale"] * 1e-4}
    shifted = {**params, "weight_zero": params["weight_zero"] + FP16_ZERO_LIMIT}
    for algo, p in (("W4A16_AWQ", tiny), ("W4A16_AWQ", shifted), ("W4A16_GPTQ", quantized("W4A16_GPTQ", w, 128)),
                    ("W4A16", quantized("W4A16", w, 32)), ("W8A16", quantized("W8A16", w, 32))):
        layout, packed = gemv_products.pack(algo, p)
        assert not layout.half_scales and packed["weight_scale"].dtype == torch.float32, algo


# --- the decode GEMV ----------------------------------------------------------------------------------------------
def _gemv_cases():
    """Under the interpreter an explicit configuration each (20 rows: a partial program; 576 columns: a short last
    group of 64 and an uneven count of blocks); on the GPU the engine's (the default run: one shape a format), and in
    the sweep for W4A16_AWQ at one row every configuration the suite sweeps (tuning.GEMV_SWEEP)."""
    shapes = ((4096, 4096), (1000, 14336), (256, 576))
    sharp = {"W8A16": (4096, 4096), "W4A16": (1000, 14336), "W4A16_GPTQ": (256, 576), "W4A16_AWQ": (4096, 4096)}
    return ([interpreted(algo, n, k, [config]) for algo in WEIGHT_ONLY
             for n, k, config in ((16, 256, (8, 32, True)), (20, 576, (8, 32, False)), (8, 2048, (4, 64, True)))]
            + [on_gpu(algo, *sharp[algo], [None]) for algo in WEIGHT_ONLY]
            + [on_gpu(algo, n, k, [None, *GEMV_SWEEP] if algo == "W4A16_AWQ" else [None], slow=True)
               for algo in WEIGHT_ONLY for n, k in shapes if algo == "W4A16_AWQ" or (n, k) != sharp[algo]])


# backend: (x from uniform [0, 1) values, tolerance): x has a mean away from 0, as activations have (zero points
# matter); float32 x under the interpreter, so the comparison sees the kernel's arithmetic (exact products, float32
# sums), not bf16 rounding
GEMV_X = {"interpreter": (lambda u: u * 2 - 0.5, 1e-5), "cuda": (lambda u: (u * 4 - 1).bfloat16(), 5e-3)}


@pytest.mark.parametrize("backend, algo, n, k, configs", _gemv_cases())
def test_weight_only_gemv(backend, algo, n, k, configs):
    """The decode GEMV on the interleaved layout against the float64 product of the same quantized weights, 1-4
    rows (a configuration of the sweep at one row)."""
    device = DEVICE[backend]
    products = QuantProducts(TritonOptions(int4_mma="off"))     # the CUDA-core GEMV's interleaved layout
    g = torch.Generator(device=device).manual_seed(n + k)
    params = quantized(algo, torch.randn((n, k), generator=g, device=device) * 0.05,
                       128 if algo == "W4A16_AWQ" else 64)
    bits = 8 if algo == "W8A16" else 4
    weight = products.pack(algo, params)[1]["weight"]
    make_x, tolerance = GEMV_X[backend]
    for rows in (1, 2, 3, 4):
        x = make_x(torch.rand((rows, k), generator=g, device=device))
        ref = quant.quant_linear(x.double(), algo, _float64(params), None)
        for config in configs if rows == 1 else configs[:1]:
            out = gemv.weight_only_gemv(x, weight, params["weight_scale"], params.get("weight_zero"), bits, config)
            assert rel_err(out, ref) < tolerance, (rows, config, rel_err(out, ref))


@pytest.mark.interpreter
@pytest.mark.parametrize("algo", ["W8A16", "W4A16_GPTQ", "W4A16_AWQ"])
@pytest.mark.parametrize("inter, k, config", [(10, 576, (8, 32, False)), (24, 256, (4, 64, True)), (12, 1536, None)])
def test_interpreted_gemv_writes_silu_of_paired_gate_up(gemv_products, algo, inter, k, config):
    """SiLU(gate)·up from the GEMV on paired rows against the float64 reference (quant_linear, then silu_and_mul) at
    1-4 rows; 2·10 rows: a partial program; 576 columns: a short last group; then the >4-row path (tiled kernel +
    silu_and_mul on the pairs) and a plain call on the paired layout, which must still give [gate | up]."""
    from kiln.kernels import ReferenceOps

    g = torch.Generator().manual_seed(inter + k)
    params = quantized(algo, torch.randn(2 * inter, k, generator=g), 128 if algo == "W4A16_AWQ" else 64)
    layout, packed = gemv_products.pack(algo, params, gated=True)
    gpu = {**params, **packed, "layout": layout}
    bits = 8 if algo == "W8A16" else 4
    for rows in (1, 2, 3, 4, 5):
        x = torch.rand(rows, k, generator=g) * 2 - 0.5
        ref = ReferenceOps.quant_linear_silu(x.double(), algo, stood_for(layout, params))
        if rows <= 4:
            out = gemv.weight_only_gemv(x, packed["weight"], packed["weight_scale"], packed.get("weight_zero"), bits,
                                        config, silu=True)
            plain = gemv.weight_only_gemv(x, packed["weight"], packed["weight_scale"], packed.get("weight_zero"), bits,
                                          config)
            assert torch.equal(out, norms.silu_and_mul(plain, paired=True))   # rounded the same
        else:
            out = gemv_products.linear_silu(x, algo, gpu, None)
            plain = gemv_products.linear(x, algo, gpu, None)
            assert rel_err(plain, quant.quant_linear(x.double(), algo, stood_for(layout, params), None)) < 1e-5
        assert out.shape == (rows, inter) and rel_err(out, ref) < 1e-5, (rows, rel_err(out, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("algo", ["W8A16", "W4A16_AWQ"])
def test_gate_up_gemv_writes_silu(algo, gemv_products):
    """The 8B gate_up on paired rows: the GEMV's SiLU(gate)·up equals the unfused GEMV + silu_and_mul bit for bit
    (1-4 rows) and the float64 reference; above 4 rows the tiled kernel + silu_and_mul reading the pairs."""
    g = torch.Generator(device="cuda").manual_seed(12)
    params = quantized(algo, torch.randn((28672, 4096), generator=g, device="cuda") * 0.05, 128)
    paired, plain = gpu_layout(gemv_products, algo, params, gated=True), gpu_layout(gemv_products, algo, params)
    assert paired["layout"].paired_rows
    for rows in (1, 2, 3, 4, 5, 64):
        x = (torch.rand((rows, 4096), generator=g, device="cuda") * 4 - 1).bfloat16()
        fused = gemv_products.linear_silu(x, algo, paired, None)
        unfused = norms.silu_and_mul(gemv_products.linear(x, algo, plain, None))
        if rows <= 4:
            assert torch.equal(fused, unfused), rows
        ref = ReferenceOps.quant_linear_silu(x.double(), algo, stood_for(paired["layout"], params))
        assert rel_err(fused, ref) < 1e-2 and rel_err(unfused, ref) < 1e-2, rows


# --- products of every mode through QuantProducts -----------------------------------------------------------------
@pytest.mark.interpreter
@pytest.mark.parametrize("algo", ["W8A16", "W4A16_AWQ"])
@pytest.mark.parametrize("half", [False, True])
def test_interpreted_tiled_matmul_reads_both_layouts(gemv_products, algo, half):
    """Both layouts, with int4 scales and zero points as float32 (scales below fp16's normal range keep them so) or
    as fp16 pairs."""
    g = torch.Generator().manual_seed(3)
    params = quantized(algo, torch.randn(24, 128, generator=g) * (1.0 if half else 1e-6), 32)
    x = torch.randn(5, 128, generator=g)
    layout, packed = gemv_products.pack(algo, params)
    assert layout.half_scales == (half and algo != "W8A16")
    for interleaved, p in ((False, params), (True, {**params, **packed, "layout": layout})):
        ref = quant.quant_linear(x.double(), algo, stood_for(layout if interleaved else None, params), None)
        assert rel_err(gemv_products.linear(x, algo, p, None), ref) < 1e-5, interleaved


@pytest.mark.parametrize("algo, rows", gpu_cases(
    [(algo, rows) for algo in (*WEIGHT_ONLY, "W8A8_SQ_PER_CHANNEL_PER_TOKEN", "FP8_PER_CHANNEL_PER_TOKEN")
     for rows in (1, 2, 3, 4, 7, 64)],
    default=[(algo, rows) for algo in WEIGHT_ONLY for rows in (3, 64)]                 # the GEMV and the tiles
    + [("W8A8_SQ_PER_CHANNEL_PER_TOKEN", 7), ("FP8_PER_CHANNEL_PER_TOKEN", 1)]))
def test_quantized_matmul_kernels(algo, rows):
    """quant_linear on the layout the engine loads (weight-only: interleaved, GEMV up to 4 rows, tiles above) and
    on the engine layout itself; 576 columns: a short last group of 64."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    w = torch.randn((1536, 576), generator=g, device="cuda")
    x = torch.randn((rows, 576), generator=g, device="cuda").bfloat16()
    params = quantized(algo, w, 128)
    ref = quant.quant_linear(x.float(), algo, params, None)
    products = QuantProducts()
    packed = products.pack(algo, params)
    layouts = [params] + ([{**params, **packed[1], "layout": packed[0]}] if packed else [])
    for p in layouts:
        assert rel_err(products.linear(x, algo, p, None), ref) < 2e-2


# backend: (rows of x, x from uniform [0, 1) values, the weight's scale, tolerance against the fp16-rounded grid's
# product, bound on the error added to the engine grid's as a fraction of int4's own)
HALF_SCALES = {"interpreter": ((1, 2, 3, 4, 5), lambda u: u * 2 - 0.5, 0.02, 1e-5, 0.05),
               "cuda": ((1, 2, 3, 4, 7, 64, 1024), lambda u: (u * 4 - 1).bfloat16(), 0.05, 5e-3, 0.1)}


@pytest.mark.parametrize("backend, n, k, seed", [interpreted(40, 256, 256), interpreted(40, 576, 576),
                                                 on_gpu(1536, 576, 1536), on_gpu(6144, 4096, 6144, slow=True),
                                                 on_gpu(4096, 14336, 4096, slow=True)])
def test_half_scale_pairs(backend, n, k, seed, gemv_products):
    """int4 g128 with zero points in the GPU layout keeps scales and zero points as fp16 pairs (one int32 per
    group: half the bytes of the float32 grid): the GEMV (1-4 rows), the tiled kernel (5-64 rows), dequantize +
    cuBLAS (1024 rows) and the dequantize kernel compute the product of the fp16-rounded grid (to float32 accuracy
    under the interpreter). fp16's rounding, against the float64 product of the engine's float32 grid, adds 3e-3
    for the interpreter's inputs (mean 0.5: the zero points' rounding, up to 2^-9 of a level for zero points of
    8-16, is summed coherently over x; 6e-4 for zero-mean x), against int4's own 9% from the float weight: under 5%
    of it, ~0.05% once added in quadrature. 576 columns: a short last group."""
    from kiln.kernels.triton import weight_only

    device = DEVICE[backend]
    rows, make_x, scale, tolerance, added_share = HALF_SCALES[backend]
    g = torch.Generator(device=device).manual_seed(seed)      # the inputs the bounds above were measured on
    w = torch.randn((n, k), generator=g, device=device) * scale
    params = quantized("W4A16_AWQ", w, 128)
    layout, packed = gemv_products.pack("W4A16_AWQ", params)
    assert layout.half_scales and packed["weight_scale"].dtype == torch.int32 and packed["weight_zero"] is None
    assert packed["weight_scale"].shape == params["weight_scale"].shape
    assert packed["weight_scale"].nbytes * 2 == params["weight_scale"].nbytes + params["weight_zero"].nbytes
    gpu = {**params, **packed, "layout": layout}
    del gpu["weight_zero"]
    exact, rounded = _float64(params), _float64(_fp16_rounded(params))
    for m in rows:
        x = make_x(torch.rand((m, k), generator=g, device=device))
        out = gemv_products.linear(x, "W4A16_AWQ", gpu, None)
        assert rel_err(out, quant.quant_linear(x.double(), "W4A16_AWQ", rounded, None)) < tolerance, m
        engine_grid = quant.quant_linear(x.double(), "W4A16_AWQ", exact, None)
        added, int4 = rel_err(out, engine_grid), rel_err(engine_grid, x.double() @ w.double().t())
        assert added < added_share * int4, (m, added, int4)
    dequantized = weight_only.dequantize(packed["weight"], packed["weight_scale"], None, 4, k, True, torch.float32)
    assert rel_err(dequantized, quant.dequantize_weight("W4A16_AWQ", rounded)) < 1e-6
    assert rel_err(quant.dequantize_weight("W4A16_AWQ", rounded), quant.dequantize_weight("W4A16_AWQ", exact)) < 1e-3


# --- a model on the GPU's products --------------------------------------------------------------------------------
@pytest.mark.interpreter
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
            params = SamplingConfig(max_new_tokens=4, end_id=-1)
            tokens[ops.name, "batch"] = [o.token_ids for o in llm.generate(prompts, params)]
            tokens[ops.name, "single"] = llm.generate(prompts[1], params).token_ids
    assert tokens["reference", "batch"] == tokens["gemv", "batch"]
    assert tokens["reference", "single"] == tokens["gemv", "single"]
    assert True in calls and False in calls


# --- FP8 products of few rows (fp8_decode) --------------------------------------------------------------------------
def _fp8_decode_cases():
    """Interpreter: a partial last program (80 rows of 64), K in 128-column steps and split in two or three, one
    weight scale for all; GPU: the Llama-3.1-8B shapes on the engine's tiles and split."""
    from kiln.kernels.triton.tuning import Fp8DecodeTile

    return ([interpreted(80, 512, Fp8DecodeTile(64, 128, 4, 2), True),
             interpreted(80, 768, Fp8DecodeTile(64, 128, 4, 2, split=3), False), interpreted(64, 96, None, False)]
            + [on_gpu(n, k, tile, True) for n, k in ((6144, 4096), (4096, 14336))
               for tile in (None, Fp8DecodeTile(64, 256, 4, 4, split=4))]
            + [on_gpu(n, k, None, False, slow=True) for n, k in ((28672, 4096), (4096, 4096), (1000, 576))])


@pytest.mark.parametrize("backend, n, k, tile, row_scales", _fp8_decode_cases())
@pytest.mark.parametrize("fast", [True, False])
def test_fp8_decode_matmul(backend, n, k, tile, row_scales, fast):
    """The swapped FP8 product against the float64 product of the same e4m3 values and scales, 1-16 rows, twice in a
    row (a split product's counters are back at zero for the next)."""
    from kiln.kernels.triton import fp8_decode

    device = DEVICE[backend]
    g = torch.Generator(device=device).manual_seed(n + k)
    w, w_scale = quant.quantize_fp8(torch.randn((n, k), generator=g, device=device) * 0.05)
    if not row_scales:
        w_scale = w_scale.max().reshape(1)
    # fast accumulation sums in the tensor cores' reduced precision: 2.9e-3 at K = 14336 on an H100, as
    # torch._scaled_mm's use_fast_accum (3.4e-3 for the same shape in benchmarks, bf16 out)
    tolerance = 1e-5 if backend == "interpreter" else (5e-3 if fast else 1e-4)
    for rows in (1, 3, 16, 3):
        x, x_scale = quant.quantize_activations_fp8(torch.randn((rows, k), generator=g, device=device))
        ref = (x.double() @ w.double().t()) * x_scale.double().reshape(-1, 1) * w_scale.double().reshape(1, -1)
        out = fp8_decode.fp8_decode_matmul(x, x_scale, w, w_scale, torch.float32, fast, tile)
        assert rel_err(out, ref) < tolerance, (rows, rel_err(out, ref))


def test_fp8_decode_takes_products_of_few_rows_and_steppable_columns(monkeypatch):
    from kiln.kernels.triton import fp8_decode, tuning

    monkeypatch.setattr(tuning, "FP8_DECODE_ROWS", 16)
    w = torch.empty((64, 4096), dtype=torch.float8_e4m3fn)
    assert fp8_decode.takes(torch.empty((16, 4096)), w)
    assert not fp8_decode.takes(torch.empty((17, 4096)), w)
    assert not fp8_decode.takes(torch.empty((1, 64)), torch.empty((64, 4096), dtype=torch.float8_e4m3fn)[:, :64])
    assert fp8_decode.config(64, 96).block_k == 32
    assert not fp8_decode.takes(torch.empty((1, 80)), torch.empty((64, 80), dtype=torch.float8_e4m3fn))
    monkeypatch.setattr(tuning, "FP8_DECODE_CONFIG", tuning.Fp8DecodeTile(block_k=256, split=4))
    assert fp8_decode.config(64, 4096).block_k == 256 and fp8_decode.config(64, 1536).block_k == 128
    monkeypatch.setattr(tuning, "FP8_DECODE_CONFIGS", {(64, 4096): None})
    assert not fp8_decode.takes(torch.empty((1, 4096)), w)
    monkeypatch.setattr(tuning, "FP8_DECODE_ROWS", 0)
    assert not fp8_decode.takes(torch.empty((1, 96)), torch.empty((64, 96), dtype=torch.float8_e4m3fn))


@pytest.mark.parametrize("shared, stages", [(227 << 10, 6), (99 << 10, 4), (30 << 10, 1)])
def test_fp8_decode_stages_fit_the_gpus_shared_memory(monkeypatch, shared, stages):
    """An H100/H200 keeps the tuned stages; a GeForce card's ~100 KB holds four of 20 KB; a tiny one still gets one."""
    from kiln.kernels.triton import fp8_decode
    from kiln.kernels.triton.tuning import Fp8DecodeTile

    monkeypatch.setattr(fp8_decode, "shared_memory", lambda device: shared)
    assert fp8_decode.fitted(Fp8DecodeTile(64, 256, 4, 6), torch.device("cuda")).num_stages == stages


@pytest.mark.gpu
def test_fp8_decode_split_products_replay_in_a_cuda_graph():
    """Split products captured in a CUDA graph, three of them back to back, replayed three times: every replay gives
    the float64 product (the counters are back at zero after each)."""
    from kiln.kernels.triton import fp8_decode
    from kiln.kernels.triton.tuning import Fp8DecodeTile

    g = torch.Generator(device="cuda").manual_seed(7)
    w, w_scale = quant.quantize_fp8(torch.randn((4096, 4096), generator=g, device="cuda") * 0.05)
    x, x_scale = quant.quantize_activations_fp8(torch.randn((3, 4096), generator=g, device="cuda"))
    ref = (x.double() @ w.double().t()) * x_scale.double() * w_scale.double()[None, :]
    tile = Fp8DecodeTile(64, 256, 4, 4, split=4)
    fp8_decode.fp8_decode_matmul(x, x_scale, w, w_scale, torch.float32, tile=tile)       # workspace made before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fp8_decode.fp8_decode_matmul(x, x_scale, w, w_scale, torch.float32, tile=tile) for _ in range(3)]
    for _ in range(3):
        for out in outs:
            out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(rel_err(out, ref) < 5e-3 for out in outs)
