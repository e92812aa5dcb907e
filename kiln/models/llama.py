"""One decoder for the Llama family: Llama 2/3/3.1, Mistral, Qwen2 (q/k/v bias) and Mixtral (MoE).

The network runs on packed tokens (no padding) over a paged KV cache; every op goes through kiln.kernels.
Its weights are the engine layout: q/k/v and gate/up fused (see fuse_weights).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import PretrainedConfig
from kiln.kernels import (AttentionMetadata, LoraBatch, NormSite, ReferenceOps, SiluSite, fuse, reference, rope_cos_sin,
                          select_ops)
from kiln.kernels.fusion import FoldedNorm, Fp8Norm, Fp8Silu, ProductBeforeNorm, stands_for
from kiln.kernels.sparse import sparse_linear, sparse_weight

from kiln.checkpoint.layout import embedding_shape, expert_shapes, linear_shapes
from kiln.checkpoint.lazy import (LazyWeights, TensorSpec, iter_take, layer_units, materialize, weight_specs,
                                  weights_device)
from kiln.checkpoint.sharding import local_dims
from kiln.distributed.comm import Comm

from .base import PretrainedModel


class RMSNorm(nn.Module):
    ops = ReferenceOps  # the kernels; DecoderForCausalLM.load sets the device's choice on every module

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x, residual=None):
        """(norm of x + residual, x + residual)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps), x
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Linear(nn.Module):
    """y = x W^T + b through the kernels; parameters named as nn.Linear's."""

    ops = ReferenceOps

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.lora = None     # the LoRA adapters' slots on this layer, a LoraStack (kiln.runtime.lora puts it)
        self.sparse = False  # the weight is 2:4 sparse, held in its device's sparse representation

    def use_sparse_weight(self, name: str) -> None:
        """Hold the (2:4 sparse) weight as the sparse path takes it (kiln.kernels.sparse); refused if it is dense."""
        self.weight = nn.Parameter(sparse_weight(self.weight.data, name), requires_grad=False)
        self.sparse = True

    def forward(self, x, silu: bool = False, lora: LoraBatch | None = None):
        """x W^T + b, plus the step's LoRA products; silu: SiLU(gate)·up of this gate/up projection's output."""
        adapters = lora is not None and self.lora is not None
        begun = self.ops.lora_begin(x, lora, self.lora) if adapters else None   # (overlaps the product below)
        out = (sparse_linear if self.sparse else self.ops.linear)(x, self.weight, self.bias)
        if adapters:
            out = self.ops.lora_finish(out, begun, lora, self.lora)
        return self.ops.silu_and_mul(out) if silu else out


class QuantLinear(nn.Module):
    """A linear layer with quantized weights (formats in kiln.kernels.quant)."""

    ops = ReferenceOps
    layout = None      # the kernels' own weight layout (set at load), or None: the engine's
    gated = False      # a gated MLP's gate/up projection: the kernels may pair its rows for calls with silu=True

    def __init__(self, in_features: int, out_features: int, bias: bool, shapes: dict[str, tuple], algo: str):
        super().__init__()
        self.algo = algo
        register_quantized(self, {name: shape for name, shape in shapes.items() if name != "bias"}, algo)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.lora = None     # the LoRA adapters' slots on this layer, a LoraStack (kiln.runtime.lora puts it)

    def quant_params(self) -> dict:
        # named_buffers(recurse=False) without its generator machinery: this runs for every layer of every step
        params = {name: t for name, t in self._buffers.items() if t is not None}
        return params if self.layout is None else {**params, "layout": self.layout}

    def use_kernel_layout(self) -> None:
        """Re-pack the weights once for the chosen kernels, where they have a layout of their own; the engine-layout
        tensors are replaced, not kept beside."""
        packed = self.ops.pack_quant(self.algo, self.quant_params(), gated=self.gated and self.bias is None)
        if packed is not None:
            self.layout, tensors = packed
            for name, tensor in tensors.items():
                setattr(self, name, tensor)

    def refit(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy new engine-layout tensors of this layer (all of its quantized ones) into its own: packed again as
        use_kernel_layout packed them, where the kernels have a layout of their own."""
        quantized = {name: t for name, t in tensors.items() if name != "bias"}
        packed = self.ops.pack_quant(self.algo, quantized, gated=self.gated and self.bias is None) \
            if self.layout is not None else None
        layout, replaced = packed if packed is not None else (None, {})
        if layout != self.layout:
            raise RuntimeError(f"refit: the kernels packed a layer as {layout}, not as its load did ({self.layout})")
        for name, tensor in {**tensors, **replaced}.items():
            copy_into(getattr(self, name), tensor, name)

    def forward(self, x, silu: bool = False, lora: LoraBatch | None = None):
        """x W^T + b, plus the step's LoRA products; silu: SiLU(gate)·up of this gate/up projection's output (its
        GEMV may apply it when no adapter adds to it)."""
        if lora is not None and self.lora is not None:
            begun = self.ops.lora_begin(x, lora, self.lora)
            out = self.ops.quant_linear(x, self.algo, self.quant_params(), self.bias)
            out = self.ops.lora_finish(out, begun, lora, self.lora)
            return self.ops.silu_and_mul(out) if silu else out
        if silu:
            return self.ops.quant_linear_silu(x, self.algo, self.quant_params(), self.bias)
        return self.ops.quant_linear(x, self.algo, self.quant_params(), self.bias)

    @property
    def takes_fp8_rows(self) -> bool:
        """Per-token FP8 activations with nothing to apply before quantizing them: the kernel that makes this
        layer's input can quantize it (quant.Fp8Rows) and save a pass."""
        return self.algo == "FP8_PER_CHANNEL_PER_TOKEN" and not {"smoother", "input_scale"} & set(self.quant_params())


def register_quantized(module: nn.Module, shapes: dict[str, tuple], algo: str) -> None:
    """Buffers for a quantized format's tensors: the weight in the format's dtype, scales (and the rest) float32."""
    weight = torch.uint8 if algo.startswith("W4A16") else torch.float8_e4m3fn if algo.startswith("FP8") else torch.int8
    for name, shape in shapes.items():
        module.register_buffer(name, torch.empty(shape, dtype=weight if name == "weight" else torch.float32))


def copy_into(target: torch.Tensor | None, tensor: torch.Tensor | None, name: str) -> None:
    """tensor copied into target's storage (its strides kept); a tensor the kernels' layout dropped stays None."""
    if target is None or tensor is None:
        if target is not tensor:
            raise RuntimeError(f"refit: {name} is {'absent' if target is None else 'present'} in the network but not "
                               "in the new weights' layout")
        return
    if target.shape != tensor.shape or target.dtype != tensor.dtype:
        raise RuntimeError(f"refit: {name} is {tuple(target.shape)} {target.dtype} in the network, "
                           f"{tuple(tensor.shape)} {tensor.dtype} in the new weights")
    with torch.no_grad():
        target.copy_(tensor)


def make_linear(name: str, in_features: int, out_features: int, bias: bool, config: PretrainedConfig) -> nn.Module:
    """A plain or a quantized linear layer, as config.quantization decides for the module `name`."""
    quant = config.quantization
    if not quant.quantizes(name):
        return Linear(in_features, out_features, bias)
    shapes = linear_shapes(name, out_features, in_features, bias, config)
    return QuantLinear(in_features, out_features, bias, {k[len(name) + 1:]: v for k, v in shapes.items()},
                       quant.quant_algo)


class Attention(nn.Module):
    """Self-attention over this rank's query and KV heads; the output projection's partial sums are all-reduced."""

    ops = ReferenceOps
    comm = Comm()

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        dims = local_dims(config)
        self.heads, self.kv_heads, self.head_dim = dims.heads, dims.kv_heads, config.head_dim
        self.qkv_proj = make_linear("attn.qkv_proj", config.hidden_size,
                                    (self.heads + 2 * self.kv_heads) * self.head_dim, config.attention_bias, config)
        self.o_proj = make_linear("attn.o_proj", self.heads * self.head_dim, config.hidden_size, config.dense_bias, config)
        self.scale = self.head_dim ** -0.5
        self.sliding_window = config.sliding_window
        # (k scale, v scale) of a quantized cache; None keeps the cache in the model's dtype
        self.register_buffer("kv_scale", torch.empty(2) if config.quantization.kv_cache_quant_algo else None)

    def forward(self, x, positions, meta: AttentionMetadata, kv_cache, cos_sin):
        t = x.shape[0]
        out = self.ops.rope_cache_attention(self.qkv_proj(x, lora=meta.lora), meta, positions, cos_sin, kv_cache,
                                            self.heads, self.kv_heads, self.head_dim, self.scale,
                                            self.sliding_window, self.kv_scale)     # (T, H, D); k, v cached
        out = self.o_proj(out.reshape(t, self.heads * self.head_dim), lora=meta.lora)
        return self.comm.all_reduce(out) if self.comm.tp_size > 1 else out


class GatedMLP(nn.Module):
    comm = Comm()

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        inter = local_dims(config).intermediate
        self.gate_up_proj = make_linear("mlp.gate_up_proj", config.hidden_size, 2 * inter, config.mlp_bias, config)
        self.down_proj = make_linear("mlp.down_proj", inter, config.hidden_size, config.mlp_bias, config)
        if isinstance(self.gate_up_proj, QuantLinear):
            self.gate_up_proj.gated = True

    def forward(self, x, lora: LoraBatch | None = None):
        out = self.down_proj(self.gate_up_proj(x, silu=True, lora=lora), lora=lora)
        return self.comm.all_reduce(out) if self.comm.tp_size > 1 else out


class QuantExperts(nn.Module):
    """One projection of a layer's experts with quantized weights: the format's tensors (kernels/quant.py), each
    with a leading expert dimension (a static input_scale is one for all). The fused MoE reads them as stored."""

    def __init__(self, shapes: dict[str, tuple], algo: str):
        super().__init__()
        self.algo = algo
        register_quantized(self, shapes, algo)

    def quant_params(self) -> dict:
        return {name: t for name, t in self._buffers.items() if t is not None}


def make_experts(name: str, experts: int, out_features: int, in_features: int, config: PretrainedConfig):
    """A projection of a layer's experts, (E, out, in): a float parameter, or QuantExperts where
    config.quantization quantizes the module `name`."""
    shapes = expert_shapes(name, experts, out_features, in_features, config)
    if name in shapes:
        return nn.Parameter(torch.empty(shapes[name]))
    return QuantExperts({k[len(name) + 1:]: v for k, v in shapes.items()}, config.quantization.quant_algo)


class MoE(nn.Module):
    """Mixture of experts over this rank's experts (or slices of every expert); partial sums are all-reduced."""

    ops = ReferenceOps
    comm = Comm()

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        dims = local_dims(config)
        e, h, i = len(dims.experts), config.hidden_size, dims.intermediate
        self.router = nn.Linear(h, config.moe_num_experts, bias=False)
        self.gate_up_proj = make_experts("moe.gate_up_proj", e, 2 * i, h, config)
        self.down_proj = make_experts("moe.down_proj", e, h, i, config)
        self.first_expert = dims.experts.start
        self.top_k, self.renormalize = config.moe_top_k, config.moe_renorm_mode == 1
        self.algo = config.quantization.quant_algo

    def forward(self, x):
        gate_up, down = (p.quant_params() if isinstance(p, QuantExperts) else p
                         for p in (self.gate_up_proj, self.down_proj))
        return self.comm.all_reduce(self.ops.moe(x, self.router.weight, gate_up, down, self.top_k, self.renormalize,
                                                 self.first_expert, self.algo))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.norm_epsilon)
        self.attn = Attention(config)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.norm_epsilon)
        if config.is_moe:
            self.moe = MoE(config)
        else:
            self.mlp = GatedMLP(config)

    def forward(self, x, residual, positions, meta, kv_cache, cos_sin):
        x, residual = self.input_norm(x, residual)
        x = self.attn(x, positions, meta, kv_cache, cos_sin)
        x, residual = self.post_attn_norm(x, residual)
        return (self.moe(x) if hasattr(self, "moe") else self.mlp(x, meta.lora)), residual


class DecoderForCausalLM(nn.Module):
    """The runtime network of one rank: packed token ids (or the previous pipeline stage's hidden states) →
    this stage's layers → hidden states, or logits on the last stage."""

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.config, self.dims = config, local_dims(config)
        self.comm = Comm()
        if self.dims.first_stage or (config.tie_word_embeddings and self.dims.last_stage):
            shape = embedding_shape(config)    # no random init: on the meta device it costs a second (its import)
            self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config) for i in self.dims.layers})
        if self.dims.last_stage:
            self.norm = RMSNorm(config.hidden_size, config.norm_epsilon)
            self.lm_head = None if config.tie_word_embeddings else make_linear(
                "lm_head", config.hidden_size, self.dims.vocab_padded // config.mapping.tp_size, False, config)
        self.cos_sin: torch.Tensor | None = None  # (max_seq_len, head_dim), set by load()

    @classmethod
    def load(cls, config: PretrainedConfig, weights, max_seq_len: int, device: torch.device | str = "cpu", ops=None,
             comm: Comm | None = None) -> "DecoderForCausalLM":
        """Build on the meta device, adopt `weights` (engine layout: a dict, or LazyWeights moved to the device a
        unit at a time) without copying them, pick the kernels and the tensor-parallel collectives."""
        net = cls.empty(config, max_seq_len, device)
        try:
            net.load_state_dict({k: v.to(device) for k, v in weights.items()}, strict=True, assign=True)
        except RuntimeError as err:
            raise ValueError(f"engine weights do not match the engine's config: {err}") from None
        if torch.device(device).type == "cpu":
            reference.use_cpu_weight_layout(net)
        net.use_ops(ops or select_ops(device), comm or Comm())
        return net.eval()

    def use_sparse_weights(self) -> None:
        """Every decoder projection on the 2:4 sparse path (BuildConfig.weight_sparsity); a dense one is refused."""
        for name, module in self.layers.named_modules():
            if isinstance(module, Linear):
                module.use_sparse_weight(f"layers.{name}.weight")

    @classmethod
    def empty(cls, config: PretrainedConfig, max_seq_len: int, device: torch.device | str = "cpu"):
        """The network with every weight on the meta device (no memory) and its rotary table on `device`."""
        with torch.device("meta"):
            net = cls(config)
        net.cos_sin = rope_cos_sin(max_seq_len, config.head_dim, config.rotary_base, config.rope_scaling).to(device)
        return net

    def use_ops(self, ops, comm: Comm | None = None) -> None:
        """Give every module the kernels and collectives; quantized layers take the kernels' layout; fusions."""
        self.ops, self.comm = ops, comm or Comm()
        comm = self.comm
        for module in self.modules():
            if hasattr(type(module), "ops"):
                module.ops = ops
            if hasattr(type(module), "comm"):
                module.comm = comm
            if isinstance(module, QuantLinear):
                module.use_kernel_layout()
        fuse(self, ops, self.fusion_sites())

    def adopt(self, weights: dict[str, torch.Tensor], device: torch.device | str) -> None:
        """Take some of the engine-layout weights (e.g. one layer's; the rest stay where they are), moved to
        `device` and laid out as `load` lays them out there."""
        result = self.load_state_dict({k: v.to(device) for k, v in weights.items()}, strict=False, assign=True)
        if result.unexpected_keys:
            raise ValueError(f"engine weights do not match the engine's config: unexpected {result.unexpected_keys}")
        if torch.device(device).type == "cpu":
            reference.use_cpu_weight_layout(self)

    @torch.no_grad()
    def refit(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy engine-layout weights (some of them, e.g. one layer's, already checked against this network's; a
        quantized layer's tensors together) into the tensors the network holds, laid out as `load` laid them out: the
        CPU's column-major matrices keep their strides, quantized layers in the kernels' own layout are packed again,
        the fusion modules go on reading the same tensors. No tensor is replaced: CUDA graphs captured over them stay
        valid."""
        by_module: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights.items():
            module, _, attribute = name.rpartition(".")
            by_module.setdefault(module, {})[attribute] = tensor
        for name, tensors in by_module.items():
            module = stands_for(self.get_submodule(name))
            if isinstance(module, QuantLinear):
                module.refit(tensors)
                continue
            for attribute, tensor in tensors.items():
                copy_into(getattr(module, attribute), tensor, f"{name}.{attribute}")

    def release(self, module: str) -> None:
        """Drop the weights of the submodule `module` (back to the meta device)."""
        self.get_submodule(module).to("meta")

    def fusion_sites(self) -> list[NormSite | SiluSite]:
        """Where the kernels may do two modules' work (kiln.kernels.fusion): each RMSNorm with the linear layer that
        reads it and the one whose output it adds to the residual stream (one rank: no all-reduce between), each
        gated MLP's SiLU with down_proj."""
        sites, before = [], None
        one_rank = self.comm.tp_size == 1
        for name, layer in self.layers.items():
            at, mlp = f"layers.{name}", hasattr(layer, "mlp")
            sites.append(NormSite(f"{at}.input_norm", f"{at}.attn.qkv_proj", before))
            sites.append(NormSite(f"{at}.post_attn_norm", f"{at}.mlp.gate_up_proj" if mlp else None,
                                  f"{at}.attn.o_proj" if one_rank else None))
            if mlp:
                sites.append(SiluSite(f"{at}.mlp.gate_up_proj", f"{at}.mlp.down_proj"))
            before = f"{at}.mlp.down_proj" if mlp and one_rank else None
        return sites

    def lora_layers(self, names) -> dict[str, Linear | QuantLinear]:
        """The linear layers `names` (layers.0.attn.qkv_proj, ...) that LoRA adapters add to (kiln.runtime.lora). A
        network whose kernels fuse a norm or SiLU into its linear layers (FP8 per-token activations, folded RMSNorms)
        is refused: there the adapters' products have no plain input or output to work on."""
        fused = [n for n, m in self.named_modules() if isinstance(m, (Fp8Norm, Fp8Silu, FoldedNorm, ProductBeforeNorm))]
        if fused:
            raise ValueError(f"LoRA adapters are not supported on this engine yet: its kernels fuse {fused[0]} with the "
                             "linear layers beside it (FP8 per-token activations, or an RMSNorm folded into int4 "
                             "products); serve adapters on a float or weight-only engine")
        layers = {name: self.get_submodule(name) for name in names}
        wrong = [name for name, layer in layers.items() if not isinstance(layer, (Linear, QuantLinear))]
        if wrong:
            raise ValueError(f"{wrong[0]} is not a linear layer of this network; no adapter part can go there")
        return layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (T, hidden); a table split across ranks is looked up piecewise and combined."""
        config, comm = self.config, self.comm
        if not config.use_parallel_embedding or comm.tp_size == 1:
            return self.embed_tokens(input_ids)
        if config.embedding_sharding_dim == 1:
            return comm.all_gather(self.embed_tokens(input_ids), dim=-1)
        rows = self.embed_tokens.weight.shape[0]
        local = input_ids - comm.tp_rank * rows
        inside = (local >= 0) & (local < rows)
        x = self.embed_tokens(local.clamp(0, rows - 1)) * inside[:, None].to(self.embed_tokens.weight.dtype)
        return comm.all_reduce(x)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor], hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after this stage: normed on the last stage, else the residual stream to send on."""
        x, residual = (self.embed(input_ids) if hidden is None else hidden), None     # (T, hidden)
        for layer, kv_cache in zip(self.layers.values(), kv_caches):
            x, residual = layer(x, residual, positions, meta, kv_cache, self.cos_sin)
        if not self.dims.last_stage:
            return x + residual
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """(N, hidden) → (N, vocab) logits, float32 or (float32=False) in the model's dtype — enough for an argmax
        and half the bytes (vocabulary shards gathered from the tensor-parallel ranks)."""
        config, comm = self.config, self.comm
        if self.lm_head is not None:
            logits = comm.all_gather(self.lm_head(hidden), dim=-1)[:, :config.vocab_size]
        elif not config.use_parallel_embedding or comm.tp_size == 1:
            logits = F.linear(hidden, self.embed_tokens.weight)
        elif config.embedding_sharding_dim == 1:
            cols = self.embed_tokens.weight.shape[1]
            logits = comm.all_reduce(F.linear(hidden[:, comm.tp_rank * cols:(comm.tp_rank + 1) * cols],
                                              self.embed_tokens.weight))
        else:
            logits = comm.all_gather(F.linear(hidden, self.embed_tokens.weight), dim=-1)[:, :config.vocab_size]
        return logits.float() if float32 else logits


_SHARED = ("input_scale", "smoother")   # per input channel/tensor: the same for every fused part
_FUSED = {"q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj"))}
_LATER_PARTS = {"k_proj", "v_proj", "up_proj"}


def fuse_weights(config: PretrainedConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint layout → engine layout: q/k/v and gate/up concatenated along the output dimension (weights,
    biases and per-output scales; input scales and smoothers are shared by the parts and kept once), experts' too;
    each fused tensor allocated once at its final size and its parts copied in."""
    return materialize(fused_view(config, weights))


def fused_view(config: PretrainedConfig, weights) -> LazyWeights:
    """The engine layout of checkpoint-layout weights (a dict, or LazyWeights) as LazyWeights made a layer at a
    time: each source tensor is made, copied into its place and dropped before the next one is made."""
    specs, places = _fused_places(weight_specs(weights))

    def make(names: list[str]) -> dict[str, torch.Tensor]:
        wanted = set(names)
        sources = [src for src, (target, _, _) in places.items() if target in wanted]
        out: dict[str, torch.Tensor] = {}
        for src, tensor in iter_take(weights, sources):
            target, dim, offset = places[src]
            if dim is None:
                out[target] = tensor
                continue
            if target not in out:
                out[target] = torch.empty(specs[target].shape, dtype=specs[target].dtype, device=tensor.device)
            out[target].narrow(dim, offset, tensor.shape[dim]).copy_(tensor)
        return out

    return LazyWeights(specs, layer_units(specs), make, f"{getattr(weights, 'source', 'model')} (fused)",
                       weights_device(weights))


def _fused_places(source: dict[str, TensorSpec]):
    """(engine name → TensorSpec, source name → (engine name, dimension it is stacked along or None: taken as it
    is, offset along it)); the parts of a fused tensor that are shared (input scales, smoothers) are taken from the
    first part only."""
    specs, places = {}, {}
    for name, spec in source.items():
        base, _, suffix = name.rpartition(".")
        head, _, module = base.rpartition(".")
        if name.endswith(("moe.gate_proj", "moe.up_proj")):         # float experts (E, out, in): rows are dim 1
            head, module, suffix, dim, members = base, suffix, "", 1, _FUSED["gate_proj"][1]
        elif module in _FUSED or module in _LATER_PARTS:
            dim, members = int(head.endswith(".moe")), next(m for f, m in _FUSED.values() if module in m)
        else:
            specs[name], places[name] = spec, (name, None, 0)
            continue
        fused = next(f for f, m in _FUSED.values() if module in m)
        target = f"{head}.{fused}" + (f".{suffix}" if suffix else "")
        if suffix in _SHARED:
            if module == members[0]:
                specs[target], places[name] = spec, (target, None, 0)
            continue
        parts = [source[f"{head}.{m}" + (f".{suffix}" if suffix else "")] for m in members]
        offset = sum(p.shape[dim] for p in parts[:members.index(module)])
        shape = list(parts[0].shape)
        shape[dim] = sum(p.shape[dim] for p in parts)
        specs[target], places[name] = TensorSpec(tuple(shape), spec.dtype), (target, dim, offset)
    return specs, places


class LlamaForCausalLM(PretrainedModel):
    """Llama 2/3/3.1, Mistral, Qwen2 and Mixtral: load from HF/GGUF or a checkpoint, save, build."""

    network_class = DecoderForCausalLM

    def engine_weights(self):
        """The engine layout: a dict, or for lazy weights LazyWeights fused a layer at a time."""
        if isinstance(self.weights, LazyWeights):
            return fused_view(self.config, self.weights)
        return fuse_weights(self.config, self.weights)


# The family shares one definition; the names follow the Hugging Face classes.
MistralForCausalLM = Qwen2ForCausalLM = MixtralForCausalLM = LlamaForCausalLM
