"""Refit (LLM.update_weights, Engine.refit): an engine built from tiny model A takes the weights of model B (same
shape, another seed) from an HF directory, a Kiln checkpoint or a state dict, and then gives B's greedy tokens;
a source that differs in any name, shape, dtype or config field changes nothing; quantized engines refit from B
quantized the same way, bit for bit, into the kernels' own layouts; cached prefixes of A are never served after the
refit; requests submitted before a refit run on A, those after on B; every rank of a TP/PP engine refits its share;
on a GPU the CUDA graphs keep working without a new capture."""
from __future__ import annotations

import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from conftest import gpu_cases, hf_greedy, save_tiny_model
from kiln import LLM, BuildConfig, SamplingConfig, build
from kiln.builder import build_sharded
from kiln.config import KvCacheConfig, Mapping, ParallelConfig, PluginConfig, PretrainedConfig, QuantConfig
from kiln.convert import quantize
from kiln.models import LlamaForCausalLM

PROMPTS = [[256, 5, 6, 7, 8, 9], [256, *range(40, 70)], [256, 100, 101]]
GREEDY = SamplingConfig(max_new_tokens=12, end_id=-1)
BUILD = BuildConfig(max_batch_size=4, max_input_len=96, max_seq_len=192, use_refit=True)


def tokens(llm: LLM, prompts=PROMPTS, sampling=GREEDY) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, sampling)]


def served(model, **llm_args) -> LLM:
    return LLM(model, build_config=BUILD, device="cpu", quiet=True, **llm_args)


@pytest.fixture(scope="module")
def ab(tiny_models, tmp_path_factory):
    """Tiny Llamas A (conftest's, seed 0) and B (seed 1): directories, B as a Kiln checkpoint, and the greedy
    tokens of engines built from each."""
    root = tmp_path_factory.mktemp("refit")
    a_dir, _ = tiny_models["llama"]
    b_hf = save_tiny_model("llama", root / "b", seed=1)
    LlamaForCausalLM.from_hugging_face(root / "b", quiet=True).save_checkpoint(root / "b_ckpt")
    with served(str(a_dir)) as llm:
        a_tokens = tokens(llm)
    with served(str(root / "b")) as llm:
        b_tokens = tokens(llm)
    assert a_tokens != b_tokens
    return SimpleNamespace(a_dir=str(a_dir), b_dir=str(root / "b"), b_ckpt=str(root / "b_ckpt"), b_hf=b_hf,
                           a_tokens=a_tokens, b_tokens=b_tokens, root=root)


def kiln_state_dict(ab) -> dict[str, torch.Tensor]:
    """B's weights with Kiln checkpoint names."""
    return dict(LlamaForCausalLM.from_checkpoint(ab.b_ckpt).weights)


SOURCES = {"hf_dir": lambda ab: ab.b_dir, "checkpoint": lambda ab: ab.b_ckpt,
           "hf_state_dict": lambda ab: ab.b_hf.state_dict(), "kiln_state_dict": kiln_state_dict}


@pytest.mark.parametrize("source", SOURCES)
def test_refit_gives_the_new_models_tokens(ab, source):
    with served(ab.a_dir) as llm:
        llm.update_weights(SOURCES[source](ab))
        assert tokens(llm) == ab.b_tokens
        assert llm.stats()["refits"] == 1
    assert ab.b_tokens[0] == hf_greedy(ab.b_hf, PROMPTS[0], GREEDY.max_new_tokens)


def test_engine_refit_and_saving_a_refitted_llm(ab, tmp_path):
    """Engine.refit copies into the engine's own tensors (equal to an engine built from B); an LLM saved after
    update_weights saves the new weights."""
    engine = build(LlamaForCausalLM.from_hugging_face(ab.a_dir, quiet=True), BUILD, quiet=True)
    held = dict(engine.weights[0])
    engine.refit(ab.b_ckpt)
    expected = build(LlamaForCausalLM.from_checkpoint(ab.b_ckpt), BUILD, quiet=True).weights[0]
    assert all(engine.weights[0][name] is tensor for name, tensor in held.items())     # copied into, not replaced
    assert all(torch.equal(engine.weights[0][name], tensor) for name, tensor in expected.items())
    with served(ab.a_dir) as llm:
        llm.update_weights(ab.b_dir)
        llm.save(tmp_path / "engine")
    with LLM(str(tmp_path / "engine"), device="cpu", quiet=True) as llm:
        assert tokens(llm) == ab.b_tokens
    lazy = build(LlamaForCausalLM.from_hugging_face(ab.a_dir, quiet=True, lazy=True), BUILD, quiet=True)
    lazy.refit(ab.b_ckpt)                           # weights read from files when used: B's files from now on
    with LLM(lazy, device="cpu", quiet=True) as llm:
        assert tokens(llm) == ab.b_tokens


@pytest.mark.parametrize("options", [dict(enable_trt_overlap=True),
                                     dict(enable_chunked_context=True, kv_cache_config=KvCacheConfig(max_tokens=192))])
def test_refit_under_overlapped_steps_and_chunked_context(ab, options):
    build_config = dataclasses.replace(BUILD, max_num_tokens=16) if "enable_chunked_context" in options else BUILD
    with LLM(ab.a_dir, build_config=build_config, device="cpu", quiet=True, **options) as llm:
        assert tokens(llm) == ab.a_tokens
        llm.update_weights(ab.b_ckpt)
        assert tokens(llm) == ab.b_tokens


def _wrong_shape(ab):
    weights = kiln_state_dict(ab)
    weights["layers.1.mlp.down_proj.weight"] = torch.zeros(64, 100)
    return weights


def _hf_wrong_shape(ab):
    state = ab.b_hf.state_dict()
    state["model.layers.0.self_attn.q_proj.weight"] = state["model.layers.0.self_attn.q_proj.weight"][:48]
    return state


def _missing(ab):
    weights = kiln_state_dict(ab)
    del weights["layers.0.post_attn_norm.weight"]
    return weights


def _unexpected(ab):
    return {**kiln_state_dict(ab), "layers.1.attn.extra.weight": torch.zeros(4)}


def _hf_unexpected(ab):
    return {**ab.b_hf.state_dict(), "model.layers.1.self_attn.extra.weight": torch.zeros(4)}


def _wrong_dtype(ab):
    weights = kiln_state_dict(ab)
    weights["norm.weight"] = weights["norm.weight"].to(torch.bfloat16)
    return weights


def _hf_wrong_dtype(ab):
    return {name: t.to(torch.bfloat16) for name, t in ab.b_hf.state_dict().items()}


def _other_config(ab):
    model = LlamaForCausalLM.from_checkpoint(ab.b_ckpt)
    config = dataclasses.replace(model.config, rotary_base=500000.0)
    path = ab.root / "b_other_rope"
    if not path.exists():
        LlamaForCausalLM(config, model.weights).save_checkpoint(path)
    return str(path)


def _quantized(ab):
    model = LlamaForCausalLM.from_checkpoint(ab.b_ckpt)
    return quantize(model, QuantConfig("W8A16"), quiet=True, round_to_nearest=True).weights


BAD = {
    "wrong_shape": (_wrong_shape, r"tensor 'layers\.1\.mlp\.down_proj\.weight' has shape \(64, 100\), expected "
                                  r"\(64, 128\)"),
    "hf_wrong_shape": (_hf_wrong_shape, r"tensor 'layers\.0\.attn\.q_proj\.weight' has shape \(48, 64\), expected "
                                        r"\(64, 64\)"),
    "missing": (_missing, r"missing tensor 'layers\.0\.post_attn_norm\.weight'"),
    "unexpected": (_unexpected, r"unexpected tensor 'layers\.1\.attn\.extra\.weight'"),
    "hf_unexpected": (_hf_unexpected, r"unexpected tensor 'model\.layers\.1\.self_attn\.extra\.weight'"),
    "wrong_dtype": (_wrong_dtype, r"tensor 'norm\.weight' is bfloat16, expected float32"),
    "hf_wrong_dtype": (_hf_wrong_dtype, r"is bfloat16, the engine's weights are float32"),
    "other_config": (_other_config, r"another model than the engine's: rotary_base=500000\.0, the engine's is "
                                    r"10000\.0"),
    "quantized_for_float": (_quantized, r"unexpected tensor '.*weight_scale'"),
    "engine_dir": (lambda ab: ab.root / "engine_a", r"is a Kiln engine"),
    "not_a_source": (lambda ab: 42, r"refit takes a Kiln checkpoint directory"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_source_that_differs_changes_nothing(ab, case):
    make, message = BAD[case]
    with served(ab.a_dir) as llm:
        if case == "engine_dir" and not (ab.root / "engine_a").exists():
            llm.save(ab.root / "engine_a")
        before = {name: t.clone() for name, t in llm.core.runner.net.state_dict().items()}
        with pytest.raises(ValueError, match=message):
            llm.update_weights(make(ab))
        after = llm.core.runner.net.state_dict()
        assert all(torch.equal(after[name], tensor) for name, tensor in before.items())
        assert tokens(llm) == ab.a_tokens and llm.stats()["refits"] == 0


def test_an_engine_built_without_use_refit_is_refused(ab):
    model = LlamaForCausalLM.from_hugging_face(ab.a_dir, quiet=True)
    with LLM(build(model, dataclasses.replace(BUILD, use_refit=False), quiet=True), device="cpu", quiet=True) as llm:
        with pytest.raises(ValueError, match=r"built without BuildConfig\.use_refit"):
            llm.update_weights(ab.b_dir)
        assert tokens(llm) == ab.a_tokens


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_every_rank_of_an_engine_refits_its_share(ab, tmp_path, tp, pp):
    """Engine.refit on an engine holding two ranks: each cuts its share of an unsharded source (HF state dict,
    checkpoint) or reads its own rank of a checkpoint of the engine's layout, and equals the rank of an engine
    built from B; a checkpoint of another layout is refused before anything changes."""
    a, b = (LlamaForCausalLM.from_hugging_face(path, quiet=True) for path in (ab.a_dir, ab.b_dir))
    expected = build_sharded(b, BUILD, tp, pp, quiet=True).weights
    b.save_checkpoint(tmp_path / "sharded", mapping=Mapping(2, 0, tp, pp))
    b.save_checkpoint(tmp_path / "other", mapping=Mapping(2, 0, pp, tp))
    for source in (ab.b_hf.state_dict(), ab.b_ckpt, str(tmp_path / "sharded")):
        engine = build_sharded(a, BUILD, tp, pp, quiet=True)
        engine.refit(source)
        for rank, weights in expected.items():
            assert all(torch.equal(engine.weights[rank][name], t) for name, t in weights.items())
    engine = build_sharded(a, BUILD, tp, pp, quiet=True)
    held = {rank: {name: t.clone() for name, t in weights.items()} for rank, weights in engine.weights.items()}
    with pytest.raises(ValueError, match=f"checkpoint of tp_size={pp}, pp_size={tp}; the engine has tp_size={tp}"):
        engine.refit(str(tmp_path / "other"))
    assert all(torch.equal(engine.weights[r][name], t) for r, weights in held.items() for name, t in weights.items())


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_a_parallel_llm_refits_on_every_rank(ab, tmp_path, tp, pp):
    """TP=2 or PP=2 with a worker process: every rank reads its share of B (an HF dir, a checkpoint of the engine's
    layout) and the LLM gives B's tokens; a state dict is refused (the worker cannot read it), and a checkpoint whose
    rank 1 file is gone fails on rank 1 alone and changes nothing on either rank."""
    b = LlamaForCausalLM.from_hugging_face(ab.b_dir, quiet=True)
    b.save_checkpoint(tmp_path / "b_sharded", mapping=Mapping(2, 0, tp, pp))
    a = LlamaForCausalLM.from_hugging_face(ab.a_dir, quiet=True)
    a.save_checkpoint(tmp_path / "a_sharded", mapping=Mapping(2, 0, tp, pp))
    (tmp_path / "a_sharded" / "rank1.safetensors").unlink()
    with served(ab.a_dir, parallel_config=ParallelConfig(tp_size=tp, pp_size=pp)) as llm:
        assert tokens(llm) == ab.a_tokens
        llm.update_weights(ab.b_dir)
        assert tokens(llm) == ab.b_tokens
        with pytest.raises(ValueError, match="not a state dict"):
            llm.update_weights(ab.b_hf.state_dict())
        with pytest.raises(ValueError, match=r"rank 1 cannot refit: FileNotFoundError: .*rank1\.safetensors"):
            llm.update_weights(tmp_path / "a_sharded")
        assert tokens(llm) == ab.b_tokens
        llm.update_weights(tmp_path / "b_sharded")
        assert tokens(llm) == ab.b_tokens and llm.stats()["refits"] == 2


QUANTIZED = {"W8A16": QuantConfig("W8A16"), "W4A16_GPTQ_g32": QuantConfig("W4A16_GPTQ", group_size=32),
             "W8A16_int8_kv": QuantConfig("W8A16", kv_cache_quant_algo="INT8")}


@pytest.mark.parametrize("mode", QUANTIZED)
def test_a_quantized_engine_refits_from_weights_quantized_the_same_way(ab, mode, tmp_path):
    """Round to nearest: B quantized as the engine was quantized from A; the refitted network (CpuOps' packed int8
    and int4 layouts included) equals the network of an engine built from B's quantized model, bit for bit."""
    quant = QUANTIZED[mode]

    def quantized(source):
        return quantize(LlamaForCausalLM.from_hugging_face(source, quiet=True), quant, calib_size=2, quiet=True,
                        round_to_nearest=True)

    b = quantized(ab.b_dir)
    b.save_checkpoint(tmp_path / "b")
    with served(b) as llm:
        expected, b_tokens = llm.core.runner.net.state_dict(), tokens(llm)
    with served(quantized(ab.a_dir)) as llm:
        with pytest.raises(ValueError, match="holds float weights and the engine is quantized"):
            llm.update_weights(ab.b_dir)
        llm.update_weights(str(tmp_path / "b"))
        refitted = llm.core.runner.net.state_dict()
        assert refitted.keys() == expected.keys()
        assert all(torch.equal(refitted[name], tensor) for name, tensor in expected.items())
        assert tokens(llm) == b_tokens


def test_prefix_blocks_of_the_old_weights_are_not_reused(ab):
    prompt = [256, *range(10, 50)]                          # two full blocks of 16 tokens
    build_config = dataclasses.replace(BUILD, plugin_config=PluginConfig(tokens_per_block=16))
    with LLM(ab.b_dir, build_config=build_config, device="cpu", quiet=True) as llm:
        b_tokens = tokens(llm, [prompt])
    with LLM(ab.a_dir, build_config=build_config, device="cpu", quiet=True,
             kv_cache_config=KvCacheConfig(enable_block_reuse=True)) as llm:
        a_tokens = tokens(llm, [prompt])
        assert tokens(llm, [prompt]) == a_tokens and llm.stats()["prefix_cache_hit_tokens"] == 32
        llm.update_weights(ab.b_ckpt)
        assert tokens(llm, [prompt]) == b_tokens != a_tokens
        assert llm.stats()["prefix_cache_hit_tokens"] == 32             # nothing found after the refit
        assert tokens(llm, [prompt]) == b_tokens and llm.stats()["prefix_cache_hit_tokens"] == 64


def test_requests_before_a_refit_run_on_the_old_weights_and_after_it_on_the_new(ab):
    """A request in flight when update_weights is called finishes on A (the refit waits for it); one submitted
    while the refit waits runs on B once it is applied."""
    long = SamplingConfig(max_new_tokens=80, end_id=-1)
    with served(ab.a_dir) as llm:
        a_long = tokens(llm, PROMPTS[:1], long)[0]
        first = llm.generate_async(PROMPTS[0], long)
        refit = threading.Thread(target=llm.update_weights, args=(ab.b_ckpt,))
        refit.start()
        while not llm._executor._deferred and llm.stats()["refits"] == 0:
            time.sleep(0.001)                               # the refit is waiting in the engine loop
        second = llm.generate_async(PROMPTS[1], GREEDY)
        aborted = llm.generate_async(PROMPTS[2], GREEDY)
        aborted.abort()
        refit.join()
        assert first.result().token_ids == a_long
        assert second.result().token_ids == ab.b_tokens[1]
        assert aborted.result().outputs[0].finish_reason in ("abort", "length")
        assert llm.stats()["refits"] == 1 and tokens(llm) == ab.b_tokens


def test_refit_after_shutdown_is_refused(ab):
    llm = served(ab.a_dir)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.update_weights(ab.b_ckpt)


def _random_quantized(quant: QuantConfig, seed: int):
    """A random Llama of 256 hidden units (int4 layers of whole int4_mma row blocks and chunks, g128) quantized by
    round to nearest."""
    config = PretrainedConfig(architecture="LlamaForCausalLM", dtype="bfloat16", vocab_size=320, hidden_size=256,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                              max_position_embeddings=256)
    model = LlamaForCausalLM.random(config, seed=seed, std=0.05)
    return quantize(model, quant, calib_size=2, quiet=True, round_to_nearest=True)


LAYOUTS = {"W4A16_AWQ": QuantConfig("W4A16_AWQ", group_size=128), "W8A16": QuantConfig("W8A16"),
           "FP8_per_token": QuantConfig("FP8_PER_CHANNEL_PER_TOKEN")}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mode", LAYOUTS)
def test_the_network_refits_into_the_gpu_kernels_layouts(mode, device):
    """DecoderForCausalLM.refit under TritonOps (refittable): int4 and int8 layers packed for the GPU's kernels
    (interleaved, gate/up rows paired; on a GPU int4_mma's fragments with the RMSNorms folded into their products),
    FP8 per-token layers behind their Fp8Norm/Fp8Silu stand-ins; B's weights copied into A's network equal B's
    network bit for bit, in the same storage. On the CPU only the layouts are made (no kernel runs)."""
    pytest.importorskip("triton")
    from kiln.kernels import TritonOps, TritonOptions
    from kiln.kernels.fusion import FoldedNorm, Fp8Norm
    from kiln.models import DecoderForCausalLM

    ops = TritonOptions(int4_mma="all" if device == "cuda" else "off", refittable=True)
    a, b = (build(_random_quantized(LAYOUTS[mode], seed), BUILD, quiet=True) for seed in (1, 2))
    if mode == "W4A16_AWQ":       # scales below fp16's range: a layout chosen by values (fp16 scales) would differ
        b.weights[0]["layers.0.attn.o_proj.weight_scale"] *= 1e-4
    a_net, b_net = (DecoderForCausalLM.load(e.pretrained_config, e.weights[0], 64, device, ops=TritonOps(ops))
                    for e in (a, b))
    stand_ins = {type(m) for m in a_net.modules()}
    assert (Fp8Norm in stand_ins) == (mode == "FP8_per_token")
    assert (FoldedNorm in stand_ins) == (mode == "W4A16_AWQ" and device == "cuda")
    before = {name: t.data_ptr() for name, t in a_net.state_dict().items()}
    a_net.refit({name: t.to(device) for name, t in b.weights[0].items()})
    refitted, expected = a_net.state_dict(), b_net.state_dict()
    assert {name: t.data_ptr() for name, t in refitted.items()} == before
    assert all(torch.equal(refitted[name], tensor) for name, tensor in expected.items())


@pytest.mark.parametrize("quant", gpu_cases([None, "W4A16_GPTQ"], default=[None]))
def test_cuda_graphs_keep_working_after_refit(quant):
    """On a GPU: the decode graphs captured over A's weights give B's tokens after a refit, with no new capture
    (the same graphs, the same tensors), equal to an engine built from B; int4 layers (the kernels' own packing,
    RMSNorms folded into int4 products) are packed again and copied in place, bit for bit."""
    from kiln.benchmark import shape_config

    def model(seed):
        made = LlamaForCausalLM.random(shape_config("smollm2-135m", "bfloat16"), seed=seed, std=0.05)
        config = QuantConfig(quant, group_size=128) if quant else None
        return quantize(made, config, calib_size=2, quiet=True, round_to_nearest=True)

    build_config = BuildConfig(max_batch_size=8, max_input_len=256, max_seq_len=512, use_refit=True)
    prompts = [list(range(5, 5 + n)) for n in (3, 50, 129)]
    sampling = SamplingConfig(max_new_tokens=20, end_id=-1)
    b = model(2)
    with LLM(b, build_config=build_config, device="cuda", quiet=True) as llm:
        expected, b_tokens = llm.core.runner.net.state_dict(), tokens(llm, prompts, sampling)
    with LLM(model(1), build_config=build_config, device="cuda", quiet=True) as llm:
        runner = llm.core.runner
        graphs, pointers = runner.graphs, {name: t.data_ptr() for name, t in runner.net.state_dict().items()}
        assert graphs is not None
        a_tokens = tokens(llm, prompts, sampling)
        llm.update_weights(b.weights)
        assert runner.graphs is graphs
        refitted = runner.net.state_dict()
        assert {name: t.data_ptr() for name, t in refitted.items()} == pointers
        assert all(torch.equal(refitted[name], tensor) for name, tensor in expected.items())
        assert tokens(llm, prompts, sampling) == b_tokens != a_tokens
        runner.graphs = None
        assert tokens(llm, prompts, sampling) == b_tokens          # eager steps agree
