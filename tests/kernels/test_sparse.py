"""2:4 sparsity (kiln/kernels/sparse.py): magnitude pruning keeps the two largest of every four inputs, the check
finds any group with more, and the sparse products — CSR on the CPU, the sparse tensor cores on a GPU — equal a
float64 product of the pruned weight."""
from __future__ import annotations

import itertools

import pytest
import torch

from kiln.kernels.sparse import dense_group, prune_2_4, sparse_linear, sparse_weight


def test_pruning_keeps_the_two_largest_of_every_four():
    torch.manual_seed(0)
    weight = torch.randn(6, 12, dtype=torch.float64)
    pruned = prune_2_4(weight)
    for row, start in itertools.product(range(6), range(0, 12, 4)):
        group = weight[row, start:start + 4].tolist()
        kept = sorted(range(4), key=lambda i: -abs(group[i]))[:2]
        expected = [group[i] if i in kept else 0.0 for i in range(4)]
        assert pruned[row, start:start + 4].tolist() == expected
    assert dense_group(pruned) is None and dense_group(weight) == (0, 0)


def test_the_check_names_the_first_dense_group():
    weight = prune_2_4(torch.randn(4, 16))
    weight[2, 9] = weight[2, 8] = weight[2, 10] = 1.0          # three nonzeros in row 2, inputs 8..11
    assert dense_group(weight) == (2, 8)
    with pytest.raises(ValueError, match=r"w is not 2:4 sparse \(row 2, inputs 8..11"):
        sparse_weight(weight, "w")
    with pytest.raises(ValueError, match="multiple of 4"):
        prune_2_4(torch.randn(4, 6))


def test_cpu_sparse_product_equals_float64():
    torch.manual_seed(1)
    weight, bias, x = prune_2_4(torch.randn(48, 64)), torch.randn(48), torch.randn(5, 64)
    sparse = sparse_weight(weight, "w")
    assert sparse.layout == torch.sparse_csr and sparse._nnz() == weight.numel() // 2
    expected = x.double() @ weight.double().T + bias.double()
    with torch.inference_mode():                                # as the runtime calls it
        torch.testing.assert_close(sparse_linear(x, sparse, bias).double(), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sparse_linear(x, sparse, None).double(), expected - bias.double(), rtol=1e-5,
                                   atol=1e-5)
    with pytest.raises(ValueError, match="on the CPU takes float32/float64 weights"):
        sparse_weight(weight.bfloat16(), "w")


# the 8B shapes' projections (qkv, o, gate/up, down) at 1 .. 2048 tokens
GPU_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 17, 256, 2048])
def test_sparse_tensor_core_product_equals_float64(dtype, tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(2)
    for out, inp in GPU_SHAPES[:2] if tokens < 2048 else GPU_SHAPES:
        weight = prune_2_4(torch.randn(out, inp, device="cuda", dtype=dtype) * 0.02)
        x = torch.randn(tokens, inp, device="cuda", dtype=dtype)
        with torch.inference_mode():
            got = sparse_linear(x, sparse_weight(weight, "w"), None)
        expected = (x.double() @ weight.double().T)
        err = (got.double() - expected).abs().max() / expected.abs().max()
        assert err < 1e-2, f"{out}x{inp} at {tokens} tokens: relative error {err:.2e}"


@pytest.mark.gpu
def test_cusparselt_plans_are_built_once_and_replay_in_cuda_graphs():
    """The runtime's sparse path calls cuSPARSELt itself: one plan per token count (26 tokens padded to 32), its
    algorithm searched once, the same product eager and replayed from a CUDA graph."""
    if not torch.cuda.is_available() or not torch.backends.cusparselt.is_available():
        pytest.skip("needs a CUDA GPU and torch with cuSPARSELt")
    from kiln.kernels import cusparselt

    assert cusparselt.library() is not None, "torch has cuSPARSELt but kiln.kernels.cusparselt did not load it"
    torch.manual_seed(3)
    weight = prune_2_4(torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16) * 0.02)
    bias = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    sparse = sparse_weight(weight, "w")
    x = torch.randn(2, 13, 2048, device="cuda", dtype=torch.bfloat16)[..., ::2]     # 26 tokens, not contiguous
    expected = x.double() @ weight.double().T + bias.double()
    with torch.inference_mode():
        cusparselt._plans.clear()
        cusparselt._algorithms.clear()
        got = sparse_linear(x, sparse, bias)
        assert len(cusparselt._plans) == 1 and got.shape == (2, 13, 512) and got.is_contiguous()
        assert len(cusparselt._algorithms) == 1                  # searched for the 32-token bucket
        assert (got.double() - expected).abs().max() < 1e-2 * expected.abs().max()
        sparse_linear(x, sparse, bias)
        assert len(cusparselt._plans) == 1                       # the same shape reuses its plan
        static = x.contiguous()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = sparse_linear(static, sparse, bias)
        static.copy_(torch.randn_like(static))
        graph.replay()
        torch.testing.assert_close(captured, sparse_linear(static, sparse, bias), rtol=0, atol=0)
