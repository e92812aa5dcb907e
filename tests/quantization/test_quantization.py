"""Quantization on the CPU: every mode's matrix product against its dequantised float reference, round trips
convert → build → load for every mode, and clear errors for combinations that make no sense."""
from __future__ import annotations

import pytest
import torch

from conftest import DATA
from kiln import LLM, BuildConfig, SamplingConfig, build
from kiln.cli.main import main
from kiln.config import ConvertConfig, QuantConfig
from kiln.convert import convert
from kiln.kernels import quant
from kiln.models import LlamaForCausalLM
from kiln.quantization import quantize_model

MODES = [("W8A16", None), ("W4A16", None), ("W4A16_GPTQ", None), ("W4A16_AWQ", None), ("W8A8_SQ_PER_CHANNEL", None),
         ("W8A8_SQ_PER_CHANNEL_PER_TOKEN", None), ("FP8", None), ("FP8_PER_CHANNEL_PER_TOKEN", None), (None, "INT8"),
         (None, "FP8"), ("W4A16_AWQ", "INT8")]


def _params(algo: str, w: torch.Tensor, group: int = 32) -> dict:
    if algo == "W8A16" or algo.startswith("W8A8"):
        q, s = quant.quantize_int8(w)
        params = {"weight": q, "weight_scale": s}
    elif algo.startswith("W4A16"):
        packed, s, z = quant.quantize_int4(w, group if algo != "W4A16" else None, algo == "W4A16_AWQ")
        params = {"weight": packed, "weight_scale": s, **({"weight_zero": z} if z is not None else {})}
    else:
        q, s = quant.quantize_fp8(w)
        params = {"weight": q, "weight_scale": s}
    return params


@pytest.mark.parametrize("algo", [m for m, _ in MODES[:8]])
def test_matmul_matches_the_dequantised_reference(algo):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 128, generator=g), torch.randn(6, 128, generator=g) * 3
    params = _params(algo, w)
    if algo == "W8A8_SQ_PER_CHANNEL":
        params["input_scale"] = x.abs().max().reshape(1) / 127
    if algo == "FP8":
        params["input_scale"] = x.abs().max().reshape(1) / quant.FP8_MAX
    w_deq = quant.dequantize_weight(algo, params).double()
    if algo.startswith("W8A8"):
        qx, sx = (quant.quantize_activations_int8(x) if "input_scale" not in params else
                  (torch.round(x / params["input_scale"]).clamp(-127, 127), params["input_scale"]))
        x_deq = qx.double() * sx.double()
    elif algo.startswith("FP8"):
        qx, sx = quant.quantize_activations_fp8(x, params.get("input_scale"))
        x_deq = qx.double() * sx.double()
    else:
        x_deq = x.double()
    out = quant.quant_linear(x, algo, params, None).double()
    ref = x_deq @ w_deq.T
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5
    assert ((ref - x.double() @ w.double().T).norm() / ref.norm()).item() < 0.2     # and it is a real approximation


def test_int4_packing_round_trips():
    q = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(quant.unpack_int4(quant.pack_int4(q)), q)


def test_int4_groups_with_a_short_last_group_and_float_zero_points():
    """576 columns in groups of 128 (4 full + 64); a min/max grid (like GGUF Q4_1) comes back exactly."""
    g = torch.Generator().manual_seed(1)
    levels = torch.randint(0, 16, (8, 576), generator=g).float()
    low = torch.randn(8, 5, generator=g).repeat_interleave(128, dim=1)[:, :576]
    step = torch.rand(8, 5, generator=g).add(0.1).repeat_interleave(128, dim=1)[:, :576]
    levels[:, ::128] = 0                                          # every group spans its full range
    levels[:, 1::128] = 15
    w = low + levels * step
    packed, scale, zero = quant.quantize_int4(w, 128, zero_point=True)
    assert scale.shape == (8, 5) and torch.allclose(quant.dequantize_int4(packed, scale, zero), w, atol=1e-5)


@pytest.mark.parametrize("algo, kv", MODES)
def test_round_trip_every_mode(tiny_models, tmp_path, algo, kv):
    hf_dir, hf_model = tiny_models["llama"]
    model = convert(hf_dir, quant_config=QuantConfig(algo, kv, group_size=32), calib_size=2, quiet=True)
    model.save_checkpoint(tmp_path / "ckpt")
    reloaded = LlamaForCausalLM.from_checkpoint(tmp_path / "ckpt")
    assert reloaded.config.quantization == model.config.quantization
    for name, tensor in model.weights.items():
        assert reloaded.weights[name].dtype == tensor.dtype and torch.equal(reloaded.weights[name], tensor), name
    build(reloaded, BuildConfig(max_input_len=64, max_seq_len=128, gather_context_logits=True),
          quiet=True).save(tmp_path / "engine")
    prompt = list(range(5, 60))
    with LLM(tmp_path / "engine", quiet=True) as llm:
        out = llm.generate(prompt, SamplingConfig(max_new_tokens=4, end_id=-1))
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0]
    error = ((out.context_logits - ref).norm() / ref.norm()).item()
    assert error < (0.35 if algo and algo.startswith("W4A16") else 0.1), error


def test_convert_flags_and_bad_combinations(tiny_models, tmp_path, capsys):
    hf_dir, _ = tiny_models["llama"]
    assert main(["convert", "--model_dir", str(hf_dir), "--output_dir", str(tmp_path / "c"), "--use_weight_only",
                 "--weight_only_precision", "int4_awq", "--per_group", "--group_size", "32", "--int8_kv_cache",
                 "--calib_size", "2"]) == 0
    q = LlamaForCausalLM.from_checkpoint(tmp_path / "c").config.quantization
    assert (q.quant_algo, q.kv_cache_quant_algo, q.group_size, q.has_zero_point) == ("W4A16_AWQ", "INT8", 32, True)
    assert main(["convert", "--model_dir", str(hf_dir), "--output_dir", str(tmp_path / "bad"), "--use_weight_only",
                 "--weight_only_precision", "int4_gptq"]) == 2
    assert "quantizes per group: add per_group" in capsys.readouterr().err
    mixtral_dir, _ = tiny_models["mixtral"]
    with pytest.raises(ValueError, match="MoE experts take W8A16, W4A16\\*, FP8\\* or no weight quantization"):
        convert(mixtral_dir, quant_config=QuantConfig("W8A8_SQ_PER_CHANNEL"), quiet=True)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model(LlamaForCausalLM.from_checkpoint(tmp_path / "c"), QuantConfig("W8A16"))
    with pytest.raises(ValueError, match="choose one of use_weight_only, smoothquant, use_fp8"):
        ConvertConfig(use_weight_only=True, smoothquant=0.5, per_channel=True)


def test_beam_search_on_a_quantized_cache(tiny_models):
    hf_dir, _ = tiny_models["qwen2"]
    model = convert(hf_dir, quant_config=QuantConfig(kv_cache_quant_algo="INT8"), calib_size=2, quiet=True)
    build_config = BuildConfig(max_batch_size=2, max_beam_width=4, max_input_len=32, max_seq_len=64)
    with LLM(model, build_config=build_config, quiet=True) as llm:
        out = llm.generate(list(range(10, 30)), SamplingConfig(max_new_tokens=8, num_beams=4, end_id=-1))
    assert len(out.outputs) == 4 and len(out.token_ids) == 8


def test_perplexity_command(tiny_models, tmp_path, capsys):
    hf_dir, _ = tiny_models["llama"]
    build(LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True), BuildConfig(max_input_len=128, max_seq_len=256),
          quiet=True).save(tmp_path / "e")
    assert main(["eval", "ppl", "--engine_dir", str(tmp_path / "e"), "--text", str(DATA / "eval.txt"), "--window", "64"]) == 0
    line = capsys.readouterr().out
    ppl = float(line.split()[1])
    assert 1.0 < ppl < 2 * 320 and "over" in line                     # a random model: near uniform over 320 tokens
    assert main(["eval", "ppl", "--engine_dir", str(tmp_path / "e"), "--text", str(tmp_path / "nope.txt")]) == 2


def _pack_awq(q: torch.Tensor) -> torch.Tensor:
    """(rows, cols) nibbles → int32 (rows, cols/8) in AutoAWQ's GEMM order (written here from its description)."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    out = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for c in range(q.shape[1] // 8):
        for i in range(8):
            out[:, c] |= q[:, c * 8 + order[i]].long() << (4 * i)
    return out.to(torch.int32)


def _pack_gptq_rows(q: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(q.shape[0] // 8, q.shape[1], dtype=torch.int64)
    for r in range(q.shape[0] // 8):
        for i in range(8):
            out[r] |= q[r * 8 + i].long() << (4 * i)
    return out.to(torch.int32)


def _pack_gptq_cols(q: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for c in range(q.shape[1] // 8):
        for i in range(8):
            out[:, c] |= q[:, c * 8 + i].long() << (4 * i)
    return out.to(torch.int32)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_import_prequantized_checkpoints(tiny_models, tmp_path, method):
    """A tiny model quantized and packed the way AutoAWQ / AutoGPTQ store it imports as W4A16 per group."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    hf_dir, hf_model = tiny_models["llama"]
    group = 32
    tensors, expected = {}, {}
    for name, w in load_file(str(hf_dir / "model.safetensors")).items():
        if not name.endswith("proj.weight"):
            tensors[name] = w
            continue
        base = name[:-len(".weight")]
        wt = w.float().t()                                         # (in, out), as these formats see it
        g = wt.reshape(wt.shape[0] // group, group, wt.shape[1])
        low, high = g.amin(dim=1), g.amax(dim=1)
        scale = ((high - low) / 15).clamp_min(1e-8)                # (in/g, out)
        zero = torch.round(-low / scale).clamp(0, 15)
        q = torch.round(g / scale[:, None] + zero[:, None]).clamp(0, 15).reshape(wt.shape).to(torch.uint8)
        expected[base] = ((q.float().reshape(g.shape) - zero[:, None]) * scale[:, None]).reshape(wt.shape).t()
        if method == "awq":
            tensors[base + ".qweight"] = _pack_awq(q)
            tensors[base + ".qzeros"] = _pack_awq(zero.to(torch.uint8))
        else:
            tensors[base + ".qweight"] = _pack_gptq_rows(q)
            tensors[base + ".qzeros"] = _pack_gptq_cols((zero - 1).clamp(min=0).to(torch.uint8))
            tensors[base + ".g_idx"] = torch.arange(wt.shape[0], dtype=torch.int32) // group
            expected[base] = ((q.float().reshape(g.shape) - zero.clamp(min=1)[:, None]) * scale[:, None]).reshape(wt.shape).t()
        tensors[base + ".scales"] = scale.half()
    out_dir = tmp_path / method
    shutil.copytree(hf_dir, out_dir)
    (out_dir / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = ({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                      "version": "gemm"} if method == "awq" else
                                     {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False})
    (out_dir / "config.json").write_text(json.dumps(config))
    model = LlamaForCausalLM.from_hugging_face(out_dir, quiet=True)
    assert model.config.quantization.quant_algo == ("W4A16_AWQ" if method == "awq" else "W4A16_GPTQ")
    q_proj = {k.split(".")[-1]: v for k, v in model.weights.items() if k.startswith("layers.0.attn.q_proj.")}
    dequant = quant.dequantize_weight(model.config.quantization.quant_algo, q_proj)
    assert torch.allclose(dequant, expected["model.layers.0.self_attn.q_proj"], atol=1e-3)
    with LLM(model, build_config=BuildConfig(max_input_len=64, max_seq_len=128, gather_context_logits=True),
             quiet=True) as llm:
        out = llm.generate(list(range(5, 60)), SamplingConfig(max_new_tokens=2, end_id=-1))
    with torch.no_grad():
        ref = hf_model(torch.tensor([list(range(5, 60))])).logits[0]
    assert ((out.context_logits - ref).norm() / ref.norm()).item() < 0.2


def _correlated_inputs(tokens: int, width: int, seed: int) -> torch.Tensor:
    """Calibration-like inputs: correlated channels of very different sizes (a few outliers)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(width, width, generator=g) / width ** 0.5 + torch.eye(width)
    return (torch.randn(tokens, width, generator=g) @ mix) * torch.rand(width, generator=g).pow(3).mul(8).add(0.2)


def test_gptq_lowers_the_layer_output_error_below_round_to_nearest():
    from kiln.quantization.gptq import gptq_fp8, gptq_int4, gptq_int8

    x = _correlated_inputs(1024, 192, 0)
    h = x.T @ x / len(x)
    w = torch.randn(64, 192, generator=torch.Generator().manual_seed(1))
    error = lambda w_hat: float(((x @ (w - w_hat).T) ** 2).sum())          # noqa: E731
    for zero_point in (False, True):
        scale, zero = quant.int4_grid(w, 64, zero_point)
        rtn = quant.int4_values(quant.int4_levels(w, scale, zero), scale, zero)
        levels = gptq_int4(w, h, scale, zero)
        assert levels.dtype == torch.uint8 and int(levels.max()) <= 15
        assert error(quant.int4_values(levels, scale, zero)) < 0.8 * error(rtn)
    int8 = gptq_int8(w, h, w.abs().amax(dim=1) / 127.0)
    assert int8.dtype == torch.int8 and int(int8.abs().max()) <= 127
    assert error(quant.dequantize_int8(int8, w.abs().amax(dim=1) / 127.0)) < \
        0.8 * error(quant.dequantize_int8(*quant.quantize_int8(w)))
    scale = w.abs().amax(dim=1) / quant.FP8_MAX
    fp8 = gptq_fp8(w, h, scale)
    assert fp8.dtype == quant.FP8
    assert error(fp8.float() * scale[:, None]) < 0.9 * error(quant.dequantize_fp8(*quant.quantize_fp8(w)))


def test_awq_searches_never_lose_to_plain_rounding():
    from kiln.quantization.awq import fake_quantize, output_error, search_clip, search_scales

    x = _correlated_inputs(1024, 256, 2)
    h = x.T @ x / len(x)
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(3))
    rtn = output_error(w - fake_quantize(w, 64, True), h)
    s = search_scales(w, h, x.abs().mean(dim=0), lambda m: fake_quantize(m, 64, True), 64)
    assert output_error(w - fake_quantize(w * s, 64, True) / s, h) < 0.9 * rtn     # outliers: scaling pays off
    ratio = search_clip(w, h, 64, True)
    assert ratio.shape == (96, 4) and float(ratio.min()) < 1.0 <= float(ratio.max())
    assert output_error(w - fake_quantize(w, 64, True, ratio), h) < rtn


@pytest.mark.parametrize("name", ["llama", "llama31_bias_tied"])
def test_awq_scale_folding_keeps_the_float_function(tiny_models, name):
    """Scales folded into the norms and into v_proj / up_proj rows (grouped-query attention, biases) leave every
    layer's float output unchanged."""
    from kiln.quantization.layerwise import LayerRunner
    from kiln.quantization.sequential import LINEARS, _apply_awq

    model = LlamaForCausalLM.from_hugging_face(tiny_models[name][0], quiet=True)
    assert model.config.num_attention_heads > model.config.num_key_value_heads
    runner = LayerRunner(model, [list(range(5, 69)), list(range(100, 140))])
    _, layer = next(iter(runner.layers()))
    before = [t.clone() for t in runner._run(layer)]
    inputs = runner.capture(layer, list(LINEARS))
    stats = {n: (x.T @ x / len(x), x.abs().mean(dim=0)) for n, x in inputs.items()}
    norm = layer.input_norm.weight.detach().clone()
    _apply_awq(layer, stats, model.config, QuantConfig("W4A16_AWQ", group_size=32))
    assert not torch.equal(norm, layer.input_norm.weight)                          # something was folded
    for old, new in zip(before, runner._run(layer)):
        assert torch.allclose(old, new, rtol=1e-4, atol=1e-5)
    after = runner.capture(layer, list(LINEARS))
    for n in LINEARS:                                                             # the inputs became X / s
        assert torch.allclose(stats[n][0], after[n].T @ after[n] / len(after[n]), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("algo", ["W8A16", "W4A16_AWQ", "W4A16_GPTQ", "FP8_PER_CHANNEL_PER_TOKEN"])
def test_calibrated_weights_beat_round_to_nearest(tiny_models, algo):
    """On text like the calibration text, the calibrated weights keep the logits closer to the float model's than
    the same grids filled by plain rounding (weights only: activations left in float on both sides)."""
    from kiln.quantization import calibration_tokens

    hf_dir, _ = tiny_models["llama"]
    model = LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True)
    prompt = calibration_tokens(model, 1, seq_len=64)[0]
    config = QuantConfig(algo, group_size=32, has_zero_point=algo != "W4A16_GPTQ")
    quantized = quantize_model(model, config, calib_size=8, quiet=True)
    calibrated, plain = dict(model.weights), dict(model.weights)
    for name, w in model.weights.items():
        if name.endswith("proj.weight"):
            base = name[:-len(".weight")]
            params = {k[len(base) + 1:]: v for k, v in quantized.weights.items() if k.startswith(base + ".weight")}
            calibrated[name] = quant.dequantize_weight(algo, params)
            plain[name] = quant.dequantize_weight(algo, _params(algo, w, 32) if algo != "W4A16_GPTQ" else
                                                  dict(zip(("weight", "weight_scale"), quant.quantize_int4(w, 32)[:2])))
    calibrated.update({k: v for k, v in quantized.weights.items() if "norm" in k})     # AWQ's folded scales
    logits = {}
    for label, weights in (("float", model.weights), ("calibrated", calibrated), ("plain", plain)):
        net = LlamaForCausalLM(model.config, weights, model.tokenizer_files, source=label)
        with LLM(net, build_config=BuildConfig(max_input_len=64, max_seq_len=128, gather_context_logits=True),
                 quiet=True) as llm:
            logits[label] = llm.generate(prompt, SamplingConfig(max_new_tokens=1, end_id=-1)).context_logits
    error = {k: ((logits[k] - logits["float"]).norm() / logits["float"].norm()).item() for k in ("calibrated", "plain")}
    assert error["calibrated"] < error["plain"], error


def test_calibration_sequences_are_distinct(tiny_models):
    from kiln.quantization import calibration_tokens

    model = LlamaForCausalLM.from_hugging_face(tiny_models["llama"][0], quiet=True)
    sequences = calibration_tokens(model, 40, seq_len=128)
    assert len(sequences) == 40 and all(len(s) > 0 for s in sequences)
    assert len({tuple(s) for s in sequences}) == 40                       # Kiln's text, then Python's documentation


def test_awq_kv_scales_cover_the_rescaled_values(tiny_models):
    """AWQ divides v_proj's rows by its scales: the KV-cache scales are measured on the quantized layers, so the
    cached values still fit the int8 range."""
    hf_dir, _ = tiny_models["llama"]
    model = LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True)
    awq = quantize_model(model, QuantConfig("W4A16_AWQ", "INT8", group_size=32), calib_size=4, quiet=True)
    plain = quantize_model(model, QuantConfig(kv_cache_quant_algo="INT8"), calib_size=4, quiet=True)
    scales = [(awq.weights[k], plain.weights[k]) for k in awq.weights if k.endswith("kv_scale")]
    assert len(scales) == model.config.num_hidden_layers
    assert any(not torch.allclose(a[1], p[1], rtol=1e-2) for a, p in scales)      # the values' range moved


@pytest.mark.parametrize("algo", ["W8A16", "W4A16_AWQ", "FP8_PER_CHANNEL_PER_TOKEN"])
def test_round_to_nearest_skips_the_searches(tiny_models, algo):
    """quantize_model(round_to_nearest=True) (random-weight benchmarks) fills the same grids by plain rounding:
    no AWQ scales folded into the norms, every matrix exactly its own round-to-nearest quantization."""
    hf_dir, _ = tiny_models["llama"]
    model = LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True)
    config = QuantConfig(algo, group_size=32, has_zero_point=algo == "W4A16_AWQ")
    quantized = quantize_model(model, config, calib_size=2, quiet=True, round_to_nearest=True)
    for name, w in model.weights.items():
        if name.endswith("proj.weight"):
            base = name[:-len(".weight")]
            expected = _params(algo, w, 32)
            for key, tensor in expected.items():
                assert torch.equal(quantized.weights[f"{base}.{key}"].float(), tensor.float()), (base, key)
        elif "norm" in name:
            assert torch.equal(quantized.weights[name], w), name


def test_grid_refit_is_the_least_squares_grid_and_never_loses():
    """With the levels fixed, refit_grid's (scale, zero) per group match a direct least-squares fit of a row's
    outputs on the calibration inputs, and no row's output error grows."""
    from kiln.quantization.refit import refit_grid, row_output_errors

    x = _correlated_inputs(1024, 192, 4)
    h = x.T @ x / len(x)
    w = torch.randn(32, 192, generator=torch.Generator().manual_seed(5))
    in_first_group = (torch.arange(192) < 128).double()                          # groups of 128 and 64
    masks = [in_first_group, 1 - in_first_group]
    for zero_point in (True, False):
        scale, zero = quant.int4_grid(w, 128, zero_point)
        levels = quant.int4_levels(w, scale, zero)
        new_scale, new_zero = refit_grid(w, h, levels, scale, zero)
        before = row_output_errors(w - quant.int4_values(levels, scale, zero), h)
        after = row_output_errors(w - quant.int4_values(levels, new_scale, new_zero), h)
        assert bool((after <= before).all()) and float(after.sum()) < 0.97 * float(before.sum())
        q = levels[0].double() - (0 if zero_point else 8)                        # row 0: ŵ = Σ scale·q + bias
        design = x.double() @ torch.stack([q * m for m in masks] + (masks if zero_point else []), dim=1)
        fit = torch.linalg.lstsq(design, x.double() @ w[0].double()).solution
        assert torch.allclose(new_scale[0].double(), fit[:2], rtol=1e-3)
        if zero_point:
            assert torch.allclose(new_zero[0].double(), -fit[2:] / fit[:2], rtol=1e-3, atol=1e-3)


def _layer_output_error(runner, layer, target) -> float:
    """The quantized network's layer output error against `target` on the calibration tokens, through the layer's
    own inference path (not the differentiable one that learned rounding trains through)."""
    hidden, residual = runner._run(layer)
    return float(((hidden + residual).float() - target).pow(2).mean())


@pytest.mark.parametrize("algo", ["W4A16_GPTQ", "W4A16_AWQ"])
def test_learned_rounding_lowers_the_layer_output_error(tiny_models, algo):
    """On a tiny model's first two layers: the layer run differentiably (LayerRunner.forward) equals its inference
    path; learned rounding moves levels by at most one and scales and zero points a little, keeps GPTQ's/AWQ's grids
    with 0 steps, and brings the layer's output closer to the float network's than those grids."""
    from kiln.quantization import calibration_tokens, sequential
    from kiln.quantization.layerwise import LayerRunner
    from kiln.quantization.tune import learn_rounding

    model = LlamaForCausalLM.from_hugging_face(tiny_models["llama"][0], quiet=True)
    config = QuantConfig(algo, group_size=32, has_zero_point=True, learned_rounding_steps=20)
    runner = LayerRunner(model, calibration_tokens(model, 4, seq_len=64))
    float_stream = runner.stream()
    for index, layer in list(runner.layers())[:2]:
        stats = sequential._statistics(runner.capture(layer, list(sequential.LINEARS)))
        hidden, residual = runner._run(layer)
        with torch.no_grad():
            target = runner.forward(layer, float_stream)
            assert torch.allclose(runner.forward(layer, runner.stream()), hidden + residual, atol=1e-5)
        if algo == "W4A16_AWQ":
            sequential._apply_awq(layer, stats, model.config, config)
        grids = {name: sequential._quantize_linear(layer.get_submodule(name), stats[name][0], config, None,
                                                   positions=True)[1] for name in sequential.LINEARS}
        before = _layer_output_error(runner, layer, target)
        for n, kept in learn_rounding(runner, layer, grids, runner.stream(), target, 0).items():
            assert torch.equal(kept.levels, grids[n].levels) and torch.equal(kept.scale, grids[n].scale)
            assert torch.equal(kept.zero, grids[n].zero)
        tuned = learn_rounding(runner, layer, grids, runner.stream(), target, 20, seed=int(index))
        for name, grid in grids.items():
            new = tuned[name]
            assert (new.levels.int() - grid.levels.int()).abs().max() <= 1
            assert (new.scale / grid.scale - 1).abs().max() < 0.1 and (new.zero - grid.zero).abs().max() < 0.1
            sequential._assign(layer.get_submodule(name).weight, quant.int4_values(new.levels, new.scale, new.zero))
        after = _layer_output_error(runner, layer, target)
        assert after < 0.9 * before, (index, before, after)
        float_stream = target
        runner.advance(layer)


def test_learned_rounding_end_to_end(tiny_models):
    """quantize_model with learned rounding keeps the logits closer to the float model's than without."""
    from kiln.quantization import calibration_tokens

    hf_dir, _ = tiny_models["llama"]
    model = LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True)
    prompt = calibration_tokens(model, 1, seq_len=64)[0]
    build_config = BuildConfig(max_input_len=64, max_seq_len=128, gather_context_logits=True)
    logits = {}
    for steps in (None, 0, 20):
        net = model if steps is None else quantize_model(
            model, QuantConfig("W4A16_GPTQ", group_size=32, has_zero_point=True, learned_rounding_steps=steps),
            calib_size=4, quiet=True)
        with LLM(net, build_config=build_config, quiet=True) as llm:
            logits[steps] = llm.generate(prompt, SamplingConfig(max_new_tokens=1, end_id=-1)).context_logits
    error = {k: ((logits[k] - logits[None]).norm() / logits[None].norm()).item() for k in (0, 20)}
    assert error[20] < 0.9 * error[0], error


def test_learned_rounding_flag_and_its_errors(tiny_models, tmp_path):
    """The convert flag reaches the checkpoint; modes it does not apply to are refused."""
    hf_dir, _ = tiny_models["llama"]
    assert main(["convert", "--model_dir", str(hf_dir), "--output_dir", str(tmp_path / "c"), "--use_weight_only",
                 "--weight_only_precision", "int4_awq", "--per_group", "--group_size", "32", "--calib_size", "2",
                 "--learned_rounding_steps", "3"]) == 0
    assert LlamaForCausalLM.from_checkpoint(tmp_path / "c").config.quantization.learned_rounding_steps == 3
    with pytest.raises(ValueError, match="learned_rounding_steps applies to the per-group int4 modes"):
        QuantConfig("W8A16", learned_rounding_steps=10)
    with pytest.raises(ValueError, match="must be an integer >= 0"):
        QuantConfig("W4A16_AWQ", learned_rounding_steps=-1)
    with pytest.raises(ValueError, match="learned rounding"):
        quantize_model(LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True),
                       QuantConfig("W4A16_AWQ", learned_rounding_steps=5), round_to_nearest=True)
