"""LoRA adapters served per request (issue 29, the CPU path): Hugging Face PEFT adapters made with `peft` on the tiny
models (random A and B, large enough to change the greedy tokens), checked against transformers + peft; several
adapters and the base model in one batch; prefix reuse keyed by adapter; the adapter cache's slots; TP=2 (gloo)."""
from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy
from peft_adapters import make_adapter, randomized
from kiln import LLM, BuildConfig, LoraCacheConfig, LoRARequest, SamplingConfig
from kiln.config import KvCacheConfig, ParallelConfig, PluginConfig

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BUILD = dict(max_batch_size=4, max_input_len=64, max_seq_len=96)
GREEDY = SamplingConfig(max_new_tokens=10, end_id=-1)
PROMPTS = [list(range(5, 25)), list(range(100, 109)), [256, 72, 101, 108, 108, 111], list(range(40, 70, 2))]


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    """Three adapters on the tiny Llama (all seven projections; attention only, rsLoRA, .bin; k/v and MLP at
    rank 4) and their transformers + peft models."""
    hf_dir, _ = tiny_models["llama"]
    root = tmp_path_factory.mktemp("adapters")
    specs = {"all": dict(targets=ALL, seed=1),
             "attn_rslora_bin": dict(targets=["q_proj", "k_proj", "o_proj"], seed=2, use_rslora=True,
                                     safetensors=False, alpha=24),
             "kv_mlp": dict(targets=["k_proj", "v_proj", "up_proj"], seed=3, r=4, alpha=4)}
    return {name: (LoRARequest(name, str(root / name)), make_adapter(hf_dir, root / name, **spec))
            for name, spec in specs.items()}


def _llm(hf_dir, **kwargs) -> LLM:
    return LLM(hf_dir, build_config=BuildConfig(**BUILD, **kwargs.pop("build", {})), quiet=True, device="cpu",
               **kwargs)


def test_each_adapter_gives_the_tokens_of_transformers_and_peft(tiny_models, adapters):
    hf_dir, base_model = tiny_models["llama"]
    base_tokens = hf_greedy(base_model, PROMPTS[0], GREEDY.max_new_tokens)
    with _llm(hf_dir) as llm:
        assert llm.generate(PROMPTS[0], GREEDY).token_ids == base_tokens
        for name, (lora, peft_model) in adapters.items():
            expected = hf_greedy(peft_model, PROMPTS[0], GREEDY.max_new_tokens)
            assert expected != base_tokens, f"adapter {name} does not change the greedy tokens: a weak test"
            assert llm.generate(PROMPTS[0], GREEDY, lora_request=lora).token_ids == expected, name


def test_mixtral_attention_adapter(tiny_models, tmp_path):
    hf_dir, base_model = tiny_models["mixtral"]
    peft_model = make_adapter(hf_dir, tmp_path / "a", ["q_proj", "k_proj", "v_proj", "o_proj"], seed=4)
    expected = hf_greedy(peft_model, PROMPTS[1], GREEDY.max_new_tokens)
    assert expected != hf_greedy(base_model, PROMPTS[1], GREEDY.max_new_tokens)
    with _llm(hf_dir) as llm:
        assert llm.generate(PROMPTS[1], GREEDY, lora_request=LoRARequest("a", tmp_path / "a")).token_ids == expected


def test_three_adapters_and_the_base_in_one_batch_equal_each_alone(tiny_models, adapters):
    hf_dir, _ = tiny_models["llama"]
    loras = [adapters["all"][0], None, adapters["attn_rslora_bin"][0], adapters["kv_mlp"][0]]
    with _llm(hf_dir) as llm:
        alone = [llm.generate(p, GREEDY, lora_request=lora).token_ids for p, lora in zip(PROMPTS, loras)]
        steps = llm.stats()["steps"]
        together = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=loras)]
        assert llm.stats()["steps"] - steps == GREEDY.max_new_tokens     # every request in every step
        swapped = llm.generate(PROMPTS[0], GREEDY, lora_request=adapters["kv_mlp"][0]).token_ids
        streamed = llm.generate_async(PROMPTS[2], GREEDY, streaming=True, lora_request=loras[2])
        assert [token for delta in streamed for token in delta.outputs[0].token_ids_diff] == alone[2]
    assert together == alone
    assert swapped != alone[0]


def test_prefix_reuse_never_shares_kv_between_adapters(tiny_models, adapters):
    """Two adapters changing k and v run the same 40-token prompt (2 full blocks of 16): with block reuse each
    gives what it gives without; the base model after them finds nothing either; the same adapter again does."""
    hf_dir, _ = tiny_models["llama"]
    prompt = list(range(3, 43))
    order = [adapters["all"][0], adapters["kv_mlp"][0], None, adapters["kv_mlp"][0]]
    build = {"plugin_config": PluginConfig(tokens_per_block=16)}
    with _llm(hf_dir, build=build) as llm:
        expected = [llm.generate(prompt, GREEDY, lora_request=lora).token_ids for lora in order]
    with _llm(hf_dir, build=build, kv_cache_config=KvCacheConfig(enable_block_reuse=True)) as llm:
        outputs = [llm.generate(prompt, GREEDY, lora_request=lora) for lora in order]
    assert [o.token_ids for o in outputs] == expected
    assert [o.num_cached_prompt_tokens for o in outputs] == [0, 0, 0, 32]
    assert len({tuple(tokens) for tokens in expected[:3]}) == 3


def test_the_adapter_cache_evicts_and_reads_again(tiny_models, adapters):
    """One device slot and one host slot for three adapters in one batch: requests of other adapters wait for the
    slot, adapters are read again from disk, and every output equals its run alone."""
    hf_dir, _ = tiny_models["llama"]
    loras = [adapters[name][0] for name in ("all", "attn_rslora_bin", "kv_mlp", "all")]
    with _llm(hf_dir) as llm:
        alone = [llm.generate(p, GREEDY, lora_request=lora).token_ids for p, lora in zip(PROMPTS, loras)]
    with _llm(hf_dir, lora_cache_config=LoraCacheConfig(max_loras=1, max_cpu_loras=1)) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=loras)] == alone
        manager = llm.core.runner.lora
        assert len(manager.host) == 1 and len(manager.slots) == 1 and manager.reads >= 5
        assert llm.stats()["steps"] >= 3 * GREEDY.max_new_tokens                 # the adapters took turns


@pytest.mark.slow
def test_tensor_parallel_adapters_equal_one_rank(tiny_models, adapters):
    """TP=2 on gloo (a worker process): A and B cut like their layers, the same tokens as one rank."""
    hf_dir, _ = tiny_models["llama"]
    loras = [adapters["all"][0], None, adapters["attn_rslora_bin"][0], adapters["kv_mlp"][0]]
    with _llm(hf_dir) as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=loras)]
    with _llm(hf_dir, parallel_config=ParallelConfig(tp_size=2)) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=loras)] == expected


def test_adapters_stored_with_the_engine_are_served_by_name(tiny_models, adapters, tmp_path):
    """BuildConfig.lora_config.lora_dir: adapters checked at build, copied into the saved engine (lora/<name>/),
    served by name from it after their directories are gone; the same in memory, before the engine is saved. An
    adapter over max_lora_rank is refused at build."""
    import shutil

    from kiln import LoraConfig

    hf_dir, _ = tiny_models["llama"]
    for name in ("all", "kv_mlp"):
        shutil.copytree(adapters[name][0].path, tmp_path / "src" / name)
    lora = LoraConfig(lora_dir=[str(tmp_path / "src" / "all"), str(tmp_path / "src" / "kv_mlp")], max_lora_rank=8)
    expected = [hf_greedy(adapters[name][1], PROMPTS[0], GREEDY.max_new_tokens) for name in ("all", "kv_mlp")]
    by_name = [LoRARequest("all"), LoRARequest("kv_mlp")]
    with _llm(hf_dir, build={"lora_config": lora}) as llm:
        assert [o.token_ids for o in llm.generate([PROMPTS[0]] * 2, GREEDY, lora_request=by_name)] == expected
        llm.save(tmp_path / "engine")
    shutil.rmtree(tmp_path / "src")
    assert sorted(p.name for p in (tmp_path / "engine" / "lora" / "all").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    with LLM(tmp_path / "engine", quiet=True, device="cpu") as llm:
        assert [o.token_ids for o in llm.generate([PROMPTS[0]] * 2, GREEDY, lora_request=by_name)] == expected
    with pytest.raises(ValueError, match="has rank 8, over the engine's max_lora_rank=4"):
        _llm(hf_dir, build={"lora_config": LoraConfig(lora_dir=[adapters["all"][0].path], max_lora_rank=4)})


@pytest.mark.slow
def test_smollm2_adapter_gives_the_tokens_of_transformers_and_peft(smollm2_model, smollm2_hf, tmp_path):
    import copy

    from peft import LoraConfig, get_peft_model

    model, tokenizer = smollm2_hf
    peft_model = randomized(get_peft_model(copy.deepcopy(model), LoraConfig(r=16, lora_alpha=32,
                                                                             target_modules=ALL)),
                             tmp_path / "smol", seed=5, std=0.04)
    prompt = tokenizer.encode("The capital of France is")
    expected = hf_greedy(peft_model, prompt, 8)
    assert expected != hf_greedy(model, prompt, 8)
    with LLM(smollm2_model, build_config=BuildConfig(**BUILD), quiet=True, device="cpu") as llm:
        assert llm.generate(prompt, SamplingConfig(max_new_tokens=8, end_id=-1),
                            lora_request=LoRARequest("smol", tmp_path / "smol")).token_ids == expected


def test_lora_plugin_reserves_the_slots_at_load(tiny_models, adapters):
    """With lora_plugin set the adapter slots exist when the engine has loaded (before its KV cache); without, they
    are allocated for the first adapter. Both give the same tokens."""
    hf_dir, _ = tiny_models["llama"]
    loras = [adapters["all"][0], None, adapters["kv_mlp"][0], adapters["attn_rslora_bin"][0]]
    with _llm(hf_dir) as llm:
        assert not llm.core.runner.lora.stacks
        plain = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=loras)]
        assert llm.core.runner.lora.stacks
    with _llm(hf_dir, build={"plugin_config": PluginConfig(lora_plugin="auto")},
              lora_cache_config=LoraCacheConfig(max_loras=3)) as llm:
        stacks = llm.core.runner.lora.stacks
        assert len(stacks) == 2 * 4 and all(s.a.shape[0] == 3 and s.rank == 64 for s in stacks.values())
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=loras)] == plain


def test_merge_lora_bakes_an_adapter_into_the_checkpoint(tiny_models, adapters, tmp_path):
    """kiln convert --merge_lora (streaming) and convert(merge_lora=) give the tokens of transformers + peft with no
    adapter at run time; an adapter of another model is refused, naming the tensor."""
    from kiln.cli.main import main
    from kiln.config import ConvertConfig
    from kiln.convert import convert

    hf_dir, _ = tiny_models["llama"]
    lora, peft_model = adapters["all"]
    expected = hf_greedy(peft_model, PROMPTS[0], GREEDY.max_new_tokens)
    assert main(["convert", "--model_dir", str(hf_dir), "--output_dir", str(tmp_path / "ckpt"),
                 "--merge_lora", lora.path]) == 0
    with _llm(str(tmp_path / "ckpt")) as llm:
        assert llm.generate(PROMPTS[0], GREEDY).token_ids == expected
    model = convert(hf_dir, convert_config=ConvertConfig(merge_lora=lora.path), quiet=True)
    with LLM(model, build_config=BuildConfig(**BUILD), quiet=True, device="cpu") as llm:
        assert llm.generate(PROMPTS[0], GREEDY).token_ids == expected
    other, _ = tiny_models["qwen2"]
    with pytest.raises(ValueError, match="has shape"):
        convert(other, convert_config=ConvertConfig(merge_lora=lora.path), quiet=True)


# --- the pieces ---------------------------------------------------------------------------------------------------
def test_prefix_keys_carry_the_adapter():
    from kiln.runtime.kv_cache import block_key

    tokens = list(range(16))
    a, b = LoRARequest("a", "/x").cache_salt, LoRARequest("b", "/x").cache_salt
    assert len({block_key(None, tokens), block_key(None, tokens, a), block_key(None, tokens, b)}) == 3
    assert block_key(None, tokens, a) == block_key(None, tokens, LoRARequest("a", "/x", id=3).cache_salt)
    parent = block_key(None, tokens, a)
    assert block_key(parent, tokens) == block_key(parent, tokens, a)      # later blocks chain from the first
    assert LoRARequest("a", "/x").cache_salt != LoRARequest("a", "/y").cache_salt


def test_no_adapter_no_lora_work(tiny_models, monkeypatch):
    """Without adapters a step carries no LoRA batch and the product is never called."""
    from kiln.kernels.reference_ops import ReferenceOps

    hf_dir, base_model = tiny_models["llama"]
    calls = []
    monkeypatch.setattr(ReferenceOps, "lora_begin", staticmethod(lambda *args: calls.append(1)))
    monkeypatch.setattr(ReferenceOps, "lora_finish", staticmethod(lambda *args: calls.append(1)))
    with _llm(hf_dir) as llm:
        assert llm.generate(PROMPTS[1], GREEDY).token_ids == hf_greedy(base_model, PROMPTS[1],
                                                                       GREEDY.max_new_tokens)
    assert not calls
