"""2:4 weight sparsity end to end: `kiln convert --prune_2_4` prunes the decoder's projections (nothing else), an
engine built with weight_sparsity runs them on the sparse path and gives the greedy tokens of transformers on the
same pruned weights (and of the dense path); dense, quantized or refittable models with the flag are refused."""
from __future__ import annotations

import pytest
import torch

from kiln import LLM, BuildConfig, SamplingConfig, build
from kiln.checkpoint.layout import SPARSE_TARGETS
from kiln.config import ConvertConfig, QuantConfig
from kiln.convert import convert_checkpoint
from kiln.kernels.sparse import dense_group, prune_2_4
from kiln.models import LlamaForCausalLM

from conftest import hf_greedy, tiny_hf_configs

GREEDY = SamplingConfig(max_new_tokens=12, end_id=-1)
SMALL = BuildConfig(max_input_len=32, max_seq_len=64)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def pruned(tiny_models, tmp_path_factory):
    hf_dir, _ = tiny_models["llama"]
    path = tmp_path_factory.mktemp("sparse") / "ckpt"
    convert_checkpoint(str(hf_dir), path, "float32", ConvertConfig(prune_2_4=True), quiet=True)
    return path


def test_prune_2_4_prunes_the_projections_only(pruned, tiny_models):
    model = LlamaForCausalLM.from_checkpoint(pruned)
    dense = LlamaForCausalLM.from_hugging_face(str(tiny_models["llama"][0]), "float32")
    targets = [name for name in model.weights if SPARSE_TARGETS.search(name)]
    assert len(targets) == 2 * len(PROJECTIONS)
    for name, tensor in model.weights.items():
        if name in targets:
            assert dense_group(tensor) is None and torch.equal(tensor, prune_2_4(dense.weights[name]))
        else:
            assert torch.equal(tensor, dense.weights[name]), name


def test_sparse_path_gives_transformers_tokens_on_the_pruned_weights(pruned, tiny_models):
    import transformers as tf

    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"][0])).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(tuple(f"{p}.weight" for p in PROJECTIONS)):
                param.copy_(prune_2_4(param))
    model = LlamaForCausalLM.from_checkpoint(pruned)
    prompts = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45]]
    with LLM(build(model, BuildConfig(**vars(SMALL) | {"weight_sparsity": True}), quiet=True), quiet=True) as llm:
        layer = llm.core.runner.net.layers["0"].attn.qkv_proj
        assert layer.sparse and layer.weight.layout == torch.sparse_csr
        sparse = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    with LLM(build(model, SMALL, quiet=True), quiet=True) as llm:
        dense = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert sparse == dense == [hf_greedy(hf, p, 12) for p in prompts]


def test_weight_sparsity_refuses_what_it_cannot_run(pruned, tiny_models):
    sparse = BuildConfig(**vars(SMALL) | {"weight_sparsity": True})
    dense = LlamaForCausalLM.from_hugging_face(str(tiny_models["llama"][0]), "float32")
    with pytest.raises(ValueError, match=r"layers.0.attn.\w_proj.weight is not 2:4 sparse .* kiln convert --prune_2_4"):
        build(dense, sparse, quiet=True)
    model = LlamaForCausalLM.from_checkpoint(pruned)
    with pytest.raises(ValueError, match="with use_refit is not supported yet"):
        build(model, BuildConfig(**vars(sparse) | {"use_refit": True}), quiet=True)
    from kiln.convert import quantize

    quantized = quantize(model, QuantConfig(quant_algo="W8A16"), calib_size=2, quiet=True)
    with pytest.raises(ValueError, match=r"this model's are quantized \(W8A16\)"):
        build(quantized, sparse, quiet=True)
    with pytest.raises(ValueError, match="bfloat16: build a float32 engine to run it here"):
        LLM(build(_bfloat16(model), sparse, quiet=True), device="cpu", quiet=True)


def _bfloat16(model):
    import dataclasses

    return type(model)(dataclasses.replace(model.config, dtype="bfloat16"),
                       {name: tensor.bfloat16() for name, tensor in model.weights.items()}, model.tokenizer_files)


@pytest.mark.gpu
def test_sparse_tensor_cores_give_the_dense_paths_logits(pruned):
    """The tiny pruned model in bf16 on the GPU: the prompt logits of the sparse path (semi-structured weights)
    against the dense path's, and decoding (CUDA graphs captured with the sparse products) runs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from torch.sparse import SparseSemiStructuredTensor

    model = _bfloat16(LlamaForCausalLM.from_checkpoint(pruned))
    prompts = [list(range(7, 30)), [3, 1, 4, 1, 5, 9, 2, 6]]
    logits = []
    for sparse in (True, False):
        config = BuildConfig(**vars(SMALL) | {"weight_sparsity": sparse, "gather_context_logits": True})
        with LLM(build(model, config, quiet=True), device="cuda", quiet=True) as llm:
            layer = llm.core.runner.net.layers["0"].mlp.gate_up_proj
            assert isinstance(layer.weight, SparseSemiStructuredTensor) == sparse
            outs = llm.generate(prompts, SamplingConfig(max_new_tokens=8, end_id=-1))
            assert all(len(o.token_ids) == 8 for o in outs)
            logits.append([o.context_logits.float() for o in outs])
    for got, expected in zip(*logits):
        err = (got - expected).abs().max() / expected.abs().max()
        assert err < 2e-2, f"relative error {err:.3e}"
