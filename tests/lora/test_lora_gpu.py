"""LoRA adapters on the GPU (issue 29): an engine with lora_plugin captures its decode graphs with the batched LoRA
kernels, and steps mixing adapters and the base model replay them, giving the CPU path's tokens. The adapters are
written directly in PEFT's layout (no peft needed on the GPU machine); their products against transformers + peft
are checked on the CPU (test_lora.py)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from kiln import LLM, BuildConfig, LoraCacheConfig, LoRARequest, SamplingConfig
from kiln.checkpoint.lora import HF_BLOCK
from kiln.config import PluginConfig

BUILD = dict(max_batch_size=4, max_input_len=64, max_seq_len=96)
GREEDY = SamplingConfig(max_new_tokens=10, end_id=-1)
PROMPTS = [list(range(5, 25)), list(range(100, 109)), [256, 72, 101, 108, 108, 111], list(range(40, 70, 2))]
SHAPES = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64), "gate_proj": (128, 64),
          "up_proj": (128, 64), "down_proj": (64, 128)}          # the tiny Llama's (out, in)


def write_adapter(path, targets: list[str], rank: int, seed: int) -> LoRARequest:
    """A PEFT adapter of the tiny Llama with A and B drawn from N(0, 0.2²): large enough to change its tokens."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for target in targets:
            out, inp = SHAPES[target]
            key = f"base_model.model.model.layers.{layer}.{HF_BLOCK[target]}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * 0.2
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.2
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "target_modules": targets}))
    return LoRARequest(path.name, str(path))


@pytest.mark.gpu
def test_adapters_run_in_cuda_graphs_and_equal_the_cpu_path(tiny_models, tmp_path, monkeypatch):
    """Decode steps mixing three adapters (ranks 8, 16, 4; all projections, attention only, k/v/up) and the base
    model replay the graphs captured with the LoRA kernels and give the CPU path's greedy tokens (float32)."""
    from kiln.runtime.cuda_graphs import CudaGraphs

    hf_dir, _ = tiny_models["llama"]
    loras = [write_adapter(tmp_path / "all", list(SHAPES), 8, 1), None,
             write_adapter(tmp_path / "attn", ["q_proj", "k_proj", "v_proj", "o_proj"], 16, 2),
             write_adapter(tmp_path / "kv_up", ["k_proj", "v_proj", "up_proj"], 4, 3)]
    build = BuildConfig(**BUILD, plugin_config=PluginConfig(lora_plugin="auto"))
    with LLM(hf_dir, build_config=build, quiet=True, device="cpu") as llm:
        expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=loras)]
        base = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert all(expected[i] != base[i] for i in (0, 2, 3)), "an adapter does not change its tokens: a weak test"
    replays = []
    run = CudaGraphs.run
    monkeypatch.setattr(CudaGraphs, "run", lambda self, *a, **kw: replays.append(kw.get("lora_slots")) or
                        run(self, *a, **kw))
    with LLM(hf_dir, build_config=build, quiet=True, device="cuda",
             lora_cache_config=LoraCacheConfig(max_loras=3)) as llm:
        assert llm.core.runner.graphs.lora_slots == 3
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=loras)] == expected
        assert sum(slots is not None and len(set(slots)) == 4 for slots in replays) >= GREEDY.max_new_tokens - 2
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == base
