"""Pure-torch kernels: the CPU path, and the oracle every fast kernel is tested against."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import quant
from .metadata import AttentionMetadata


def use_cpu_weight_layout(module: torch.nn.Module) -> None:
    """Store 2-D matrices column-major (same shapes, transposed strides): on x86 CPUs the one-token products of
    decoding (x @ W^T with W stored (in, out)) run about 25% faster, the LM head about 2x (docs/performance.md)."""
    for param in module.parameters():
        if param.dim() == 2 and param.is_contiguous():
            param.data = param.data.t().contiguous().t()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, scaled in the input dtype (as transformers does)."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotate(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D) rotated by cos_sin gathered for its tokens, (T, 1, D) = [cos | sin] halves."""
    cos, sin = cos_sin.chunk(2, dim=-1)                          # (T, 1, D/2) each
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    """Rotate q (T, H, D) and k (T, KH, D) by their positions; cos_sin is (P, D) = [cos | sin] halves,
    or already gathered for these positions, (T, 1, D)."""
    if cos_sin.dim() == 2:
        cos_sin = cos_sin[positions].unsqueeze(1)
    return rotate(q, cos_sin), rotate(k, cos_sin)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's first largest column (greedy decoding)."""
    return x.argmax(dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def lora(out: torch.Tensor, x: torch.Tensor, batch, stack) -> torch.Tensor:
    """Add the LoRA products of a step to a layer's output `out` (T, N), in place, and return it. For each group
    (slot, rows) of `batch` (a LoraBatch: the packed tokens computed under adapter `slot`) and each part p of the
    layer's LoraStack `stack` (kiln/kernels/lora.py), out[rows, bounds[p]:bounds[p + 1]] +=
    scale[slot, p]·(x[rows]·A_pᵀ)·B_pᵀ. A slot holding no adapter part on this layer adds nothing."""
    r = stack.rank
    for slot, rows in batch.groups:
        if not stack.filled(slot):
            continue
        shrunk = x[rows] @ stack.a[slot].t()                                 # (t, P·R)
        for p, (begin, end) in enumerate(zip(stack.bounds, stack.bounds[1:])):
            scale = stack.host_scale[slot][p]
            if scale == 0.0:
                continue
            cols = out[:, begin:end]                                         # (T, n): a view of out
            part = shrunk[:, p * r:(p + 1) * r]
            if isinstance(rows, slice):
                cols[rows].addmm_(part, stack.b[slot, begin:end].t(), alpha=scale)
            else:
                cols.index_add_(0, rows, part @ stack.b[slot, begin:end].t(), alpha=scale)
    return out


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """k or v in the cache's dtype: as is, or divided by its scale and rounded to int8 / cast to fp8."""
    if dtype == torch.int8:
        return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)
    if dtype == torch.float8_e4m3fn:
        return (x.float() / scale).clamp(-448, 448).to(dtype)
    return x.to(dtype)


def dequantize_kv(k: torch.Tensor, v: torch.Tensor, kv_scale: torch.Tensor | None, dtype: torch.dtype):
    """k and v read from the cache, in `dtype`: times their scales where the cache is quantized (quantize_kv)."""
    if kv_scale is None:
        return k, v
    return (k.float() * kv_scale[0]).to(dtype), (v.float() * kv_scale[1]).to(dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scale: torch.Tensor | None = None) -> None:
    """Store k, v (T, KH, D) at their slots of kv_cache (2, num_blocks, tokens_per_block, KH, D); a quantized
    cache stores k / kv_scale[0] and v / kv_scale[1]."""
    ks, vs = (kv_scale[0], kv_scale[1]) if kv_scale is not None else (None, None)
    kv_cache[0].view(-1, *k.shape[1:])[slot_mapping] = quantize_kv(k, ks, kv_cache.dtype)
    kv_cache[1].view(-1, *v.shape[1:])[slot_mapping] = quantize_kv(v, vs, kv_cache.dtype)


def _gather_plan(meta: AttentionMetadata, sliding_window: int | None):
    """Index tensors that turn the packed batch into a padded (B, Q, ·) query and (B, K, ·) cache view."""
    key = ("reference", sliding_window)
    if key in meta.scratch:
        return meta.scratch[key]
    device = meta.seq_lens.device
    q_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]               # (B,)
    i = torch.arange(meta.max_query_len, device=device)                         # (Q,)
    j = torch.arange(meta.max_seq_len, device=device)                           # (K,)
    blocks = meta.block_tables[:, (j // meta.tokens_per_block).clamp(max=meta.block_tables.shape[1] - 1)]
    slots = blocks * meta.tokens_per_block + j % meta.tokens_per_block           # (B, K)
    q_pos = (meta.seq_lens - q_lens)[:, None] + i                               # (B, Q)
    mask = (j <= q_pos[:, :, None]) & (j < meta.seq_lens[:, None, None])        # (B, Q, K)
    if sliding_window is not None:
        mask &= j > q_pos[:, :, None] - sliding_window
    q_valid = i < q_lens[:, None]                                               # (B, Q)
    q_index = (meta.query_start_loc[:-1, None] + i).clamp(max=int(meta.query_start_loc[-1]) - 1)
    meta.scratch[key] = plan = (slots, mask.unsqueeze(1), q_valid, q_index)
    return plan


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None = None, kv_scale: torch.Tensor | None = None,
                    fp8_queries: bool = False) -> torch.Tensor:
    """Causal attention of packed queries q (T, H, D) over each sequence's cached keys/values → (T, H, D).

    The new tokens' k/v must already be written to the cache (write_kv). Grouped-query heads attend as
    (B, KH, Q * G, D) queries against (B, KH, K, D) keys, so the cache is never repeated per head.
    fp8_queries (FP8 context attention, over an e4m3 cache): each (token, head) row of q is first rounded to e4m3
    with its own scale, as the kernels multiply it, but the rows of the step's leading decode tokens
    (meta.decode_seqs), which attend as a decode step's."""
    if fp8_queries and kv_cache.dtype == torch.float8_e4m3fn:
        values, step = quant.quantize_activations_fp8(q)
        rounded = values.float() * step
        rounded[:meta.decode_seqs] = q[:meta.decode_seqs].float()
        return paged_attention(rounded, kv_cache, meta, scale, sliding_window, kv_scale).to(q.dtype)
    slots, mask, q_valid, q_index = _gather_plan(meta, sliding_window)
    heads, kv_heads, dim = q.shape[1], kv_cache.shape[-2], q.shape[-1]
    group = heads // kv_heads
    k = kv_cache[0].flatten(0, 1)[slots].transpose(1, 2)                       # (B, KH, K, D)
    v = kv_cache[1].flatten(0, 1)[slots].transpose(1, 2)
    k, v = dequantize_kv(k, v, kv_scale, q.dtype)
    b, queries = q_index.shape
    qp = q[q_index].view(b, queries, kv_heads, group, dim).permute(0, 2, 1, 3, 4).reshape(b, kv_heads, -1, dim)
    if group > 1 and queries > 1:
        mask = mask.repeat_interleave(group, dim=2)                              # (B, 1, Q * G, K)
    out = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale)  # (B, KH, Q * G, D)
    out = out.view(b, kv_heads, queries, group, dim).permute(0, 2, 1, 3, 4).reshape(b, queries, heads, dim)
    return out[q_valid]                                                          # (T, H, D)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) in x's dtype, experts (T, k)) of each token: the top_k of the router's softmax (float32),
    renormalised to sum to one where `renormalize` (Mixtral)."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)                  # (T, E)
    weights, experts = torch.topk(probs, top_k, dim=-1)                         # (T, k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def expert_params(params: dict, expert: int) -> dict:
    """One expert's tensors of a quantized projection stacked over experts (the static input scale is shared)."""
    return {name: t if name == "input_scale" else t[expert] for name, t in params.items()}


def expert_linear(x: torch.Tensor, weight: torch.Tensor | dict, expert: int, algo: str | None) -> torch.Tensor:
    """x times one expert's projection: a float (E, out, in) tensor, or a dict of `algo`'s stacked tensors."""
    if isinstance(weight, dict):
        return quant.quant_linear(x, algo, expert_params(weight, expert), None)
    return F.linear(x, weight[expert])


def moe(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor | dict, down: torch.Tensor | dict, top_k: int,
        renormalize: bool, first_expert: int = 0, algo: str | None = None) -> torch.Tensor:
    """Mixture of experts: route each token (T, H) to top_k experts of gate_up (E, 2I, H), down (E, H, I).
    The router scores all experts; this call computes only experts first_expert .. first_expert + E - 1 (the
    rest live on other ranks and their contributions arrive through an all-reduce). gate_up and down are float
    tensors or, quantized, dicts of `algo`'s tensors (kernels/quant.py) with a leading expert dimension."""
    weights, experts = route(x, router, top_k, renormalize)
    local_experts = (gate_up["weight"] if isinstance(gate_up, dict) else gate_up).shape[0]
    out = torch.zeros_like(x)
    for e in experts.unique().tolist():
        local = e - first_expert
        if not 0 <= local < local_experts:
            continue
        token, slot = (experts == e).nonzero(as_tuple=True)
        h = silu_and_mul(expert_linear(x[token], gate_up, local, algo))
        out.index_add_(0, token, expert_linear(h, down, local, algo) * weights[token, slot, None])
    return out
