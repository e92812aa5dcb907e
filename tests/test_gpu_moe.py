"""The fused MoE on the GPU (`pytest -m gpu tests/test_gpu_moe.py`, skipped without one): every expert format against
the float64 reference for 1 to 4096 tokens of 8 experts, top-2, balanced and unbalanced routing; a tiny Mixtral's
greedy tokens against the CPU path; the layer and a model's decode steps in CUDA graphs against eager runs."""
from __future__ import annotations

import pytest
import torch

from test_moe import KERNEL_FORMATS, TOLERANCE, moe_case, oracle_moe, rel_err

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
H, INTER = 256, 384                      # 384 inputs of down: three groups of 128, a last step of 64 at 128 a step


@pytest.mark.parametrize("algo, statics", KERNEL_FORMATS)
def test_fused_moe_matches_float64(algo, statics):
    """bfloat16 over token counts that pick every block size (kernels/triton/tuning.MOE_CONFIGS) for float experts and
    the decode and prefill sizes for the others; 'one': every token to experts 0 and 1, the six others empty."""
    from kiln.kernels.triton.fused_moe import fused_moe

    counts = (1, 2, 3, 16, 33, 100, 256, 777, 4096) if algo is None else (1, 33, 777, 4096)
    for t in counts:
        for routing in ("random", "one"):
            x, router, gate_up, down = moe_case(algo, statics, t, 8, H, INTER, torch.bfloat16, routing, CUDA, seed=t)
            out = fused_moe(x, router, gate_up, down, 2, True, 0, algo)
            error = rel_err(out, oracle_moe(x, router, gate_up, down, 2, True, algo))
            assert out.shape == x.shape and error < TOLERANCE[torch.bfloat16], (t, routing, error)


@pytest.mark.parametrize("algo", [None, "W4A16_AWQ", "FP8_PER_CHANNEL_PER_TOKEN"])
def test_fused_moe_in_float16(algo):
    """(float32 runs in the tiny Mixtral below.) e4m3 dots accumulate as the tensor cores do by default (fast
    accumulation: 2.8e-3 from float64 at one token, against 2e-4 for the other formats)."""
    from kiln.kernels.triton.fused_moe import fused_moe

    tolerance = 1e-2 if algo and algo.startswith("FP8") else TOLERANCE[torch.float16]
    for t in (1, 300):
        x, router, gate_up, down = moe_case(algo, None, t, 8, H, INTER, torch.float16, device=CUDA, seed=t)
        out = fused_moe(x, router, gate_up, down, 2, True, 0, algo)
        assert rel_err(out, oracle_moe(x, router, gate_up, down, 2, True, algo)) < tolerance, t


@pytest.mark.parametrize("algo, statics", [(None, None), ("W4A16_GPTQ", None), *KERNEL_FORMATS[-2:]])
def test_fused_moe_replays_in_a_cuda_graph(algo, statics):
    """Captured once, replayed on new inputs that route differently: the eager result each time (no host sync,
    no shape that depends on the routing)."""
    from kiln.kernels.triton.fused_moe import fused_moe

    for t in (1, 24):
        x, router, gate_up, down = moe_case(algo, statics, t, 8, H, INTER, torch.bfloat16, device=CUDA, seed=t)
        static_x = x.clone()
        fused_moe(static_x, router, gate_up, down, 2, True, 0, algo)         # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fused_moe(static_x, router, gate_up, down, 2, True, 0, algo)
        for seed in (1, 2, 3):
            fresh = torch.randn(x.shape, generator=torch.Generator(device="cuda").manual_seed(seed), device=CUDA)
            static_x.copy_(fresh.to(x.dtype))
            graph.replay()
            assert torch.equal(static_out, fused_moe(static_x, router, gate_up, down, 2, True, 0, algo)), (t, seed)


def _tiny_mixtral(dtype: str):
    import transformers

    from conftest import tiny_hf_configs
    from kiln.models import LlamaForCausalLM

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_hf_configs()["mixtral"])
    return LlamaForCausalLM.from_hugging_face(hf, dtype=dtype)


@pytest.mark.parametrize("algo", [None, "W8A16", "W4A16_AWQ"])
def test_tiny_mixtral_greedy_tokens_equal_the_cpu_path_in_float32(algo):
    """Prefill and CUDA-graph decode steps through the fused MoE give the reference's greedy tokens (ReferenceOps on
    the CPU, cpu_kernels="reference": CpuOps computes int8/int4 layers in bf16)."""
    from kiln import LLM, BuildConfig, SamplingConfig
    from kiln.config import PluginConfig, QuantConfig
    from kiln.quantization import quantize_model

    model = _tiny_mixtral("float32")
    if algo is not None:
        model = quantize_model(model, QuantConfig(algo, group_size=32), calib_size=2, quiet=True)
    prompts = [list(range(3, 3 + n)) for n in (1, 40, 200)]
    build = BuildConfig(max_batch_size=4, max_input_len=256, max_seq_len=512,
                        plugin_config=PluginConfig(cpu_kernels="reference"))
    tokens = {}
    for device in ("cpu", "cuda"):
        with LLM(model, build_config=build, device=device, quiet=True) as llm:
            tokens[device] = [o.token_ids for o in llm.generate(prompts, SamplingConfig(max_new_tokens=16, end_id=-1))]
    assert tokens["cuda"] == tokens["cpu"]


def test_mixtral_decode_in_cuda_graphs_equals_eager():
    from kiln import LLM, BuildConfig, SamplingConfig

    model = _tiny_mixtral("bfloat16")
    prompts = [list(range(5, 5 + n)) for n in (3, 50, 100, 7, 129)]
    with LLM(model, build_config=BuildConfig(max_batch_size=8, max_input_len=256, max_seq_len=512), device=CUDA,
             quiet=True) as llm:
        assert llm.core.runner.graphs is not None
        graphed = [o.token_ids for o in llm.generate(prompts, SamplingConfig(max_new_tokens=20, end_id=-1))]
        llm.core.runner.graphs = None
        eager = [o.token_ids for o in llm.generate(prompts, SamplingConfig(max_new_tokens=20, end_id=-1))]
    assert graphed == eager
