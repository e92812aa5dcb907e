"""ConvertConfig: the seed's `checkpoint:` section, i.e. the flags of `kiln convert`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fields import from_dict, reject_unsupported, require_positive
from .pretrained import PretrainedConfig
from .quant import QuantConfig, excluded_modules

# ConvertConfig field → PretrainedConfig field it pins down.
SHAPE_FIELDS = {
    "vocab_size": "vocab_size", "n_positions": "max_position_embeddings", "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads", "n_embd": "hidden_size", "inter_size": "intermediate_size",
    "n_kv_head": "num_key_value_heads", "rms_norm_eps": "norm_epsilon", "hidden_act": "hidden_act",
    "rotary_base": "rotary_base", "moe_num_experts": "moe_num_experts", "moe_top_k": "moe_top_k",
    "moe_renorm_mode": "moe_renorm_mode",
}


@dataclass
class ConvertConfig:
    """How a Hugging Face model becomes a Kiln checkpoint. The shape fields (vocab_size … moe_renorm_mode)
    describe the model: with a model directory each one given must agree with the model's own config;
    without one they define a random-weight model of that shape."""

    tp_size: int = 1
    """Tensor parallelism of the checkpoint."""
    pp_size: int = 1
    """Pipeline parallelism of the checkpoint."""
    vocab_size: int | None = None
    """Vocabulary size."""
    n_positions: int | None = None
    """Maximum number of positions (max_position_embeddings)."""
    n_layer: int | None = None
    """Number of decoder layers."""
    n_head: int | None = None
    """Number of attention heads."""
    n_embd: int | None = None
    """Hidden size."""
    inter_size: int | None = None
    """MLP intermediate size."""
    n_kv_head: int | None = None
    """Number of key/value heads."""
    rms_norm_eps: float | None = None
    """RMSNorm epsilon."""
    hidden_act: str | None = None
    """MLP activation."""
    rotary_base: float | None = None
    """Rotary embedding base."""
    moe_num_experts: int | None = None
    """Experts per MoE layer."""
    moe_top_k: int | None = None
    """Experts per token."""
    moe_renorm_mode: int | None = None
    """1: renormalise the top-k routing weights."""
    moe_tp_mode: int = 0
    """MoE experts across tensor-parallel ranks: 0 expert parallel (experts divided), 1 tensor parallel."""
    meta_ckpt_dir: str | None = None
    """A Meta (consolidated.*.pth) checkpoint directory: not supported (convert the HF model), so refused."""
    use_weight_only: bool = False
    """Weight-only quantization (W8A16 / W4A16)."""
    weight_only_precision: str = "int8"
    """int8, int4 (per channel), int4_gptq (per group) or int4_awq (per group with zero points)."""
    smoothquant: float | None = None
    """SmoothQuant W8A8 with this migration strength alpha (0.5 is usual)."""
    per_channel: bool = False
    """SmoothQuant: per-channel weight scales (required: Kiln has no per-tensor int8 weights)."""
    per_token: bool = False
    """SmoothQuant: dynamic per-token activation scales instead of one calibrated per-tensor scale."""
    int8_kv_cache: bool = False
    """INT8 KV cache with calibrated per-layer scales."""
    use_fp8: bool = False
    """FP8 (e4m3) weights per channel and activations with a calibrated per-tensor scale."""
    fp8_per_token: bool = False
    """With use_fp8: dynamic per-token activation scales instead of a calibrated one."""
    fp8_kv_cache: bool = False
    """FP8 KV cache with calibrated per-layer scales."""
    quantize_lm_head: bool = False
    """Quantize the LM head too (left in the model dtype by default)."""
    calib_size: int = 16
    """Calibration sequences (of up to 256 tokens) taken from Kiln's calibration text."""
    learned_rounding_steps: int = 0
    """int4_gptq / int4_awq: steps of learned rounding after GPTQ or AWQ (QuantConfig.learned_rounding_steps)."""
    round_to_nearest: bool = False
    """Round the weights to nearest, skipping the calibrated searches of int8, int4_gptq, int4_awq and FP8 (GPTQ,
    AWQ): the same layout, seconds instead of minutes, less accurate (TensorRT-LLM's weight-only default)."""
    ammo_quant_ckpt_path: str | None = None
    """A pre-quantized checkpoint (.npz)."""
    per_group: bool = False
    """Per-group INT4 (required by int4_gptq and int4_awq)."""
    group_size: int = 128
    """Group size of per-group quantization (32, 64 or 128)."""
    dataset_cache_dir: str | None = None
    """Calibration dataset cache."""
    disable_weight_only_quant_plugin: bool = False
    """Use the non-plugin weight-only path."""
    load_by_shard: bool = False
    """With tp_size/pp_size: read each rank's share of the HF checkpoint a tensor at a time, so host memory holds
    one rank's weights instead of the whole model (not with quantization, which calibrates the whole model). With
    one rank, its share is the whole model; a random-weight model (no model directory) has nothing to read, so it
    is refused there."""
    load_model_on_cpu: bool = True
    """Convert on the host (False, converting on the GPU, is not supported)."""
    use_parallel_embedding: bool = False
    """Split the embedding across tensor-parallel ranks."""
    embedding_sharding_dim: int = 0
    """Dimension the embedding is split along (0: vocab, 1: hidden)."""
    use_embedding_sharing: bool = False
    """Share one table between the embedding and the LM head: Kiln does so for models with tied embeddings
    (set for any other model it is an error)."""
    prune_2_4: bool = False
    """Magnitude-prune the decoder's projection weights to 2:4 sparsity (the two largest of every four consecutive
    inputs kept), after merge_lora and before quantizing: a checkpoint for BuildConfig.weight_sparsity. It costs
    accuracy unless the model was trained sparse: measure it with kiln eval ppl."""
    merge_lora: str | None = None
    """A Hugging Face PEFT adapter directory merged into the weights (W + scale·B·A on each target projection, in
    float32) before quantizing: the checkpoint is the fine-tuned model, served without LoRA products."""
    workers: int = 1
    """Ranks sharded and written in parallel (threads)."""
    save_config_only: bool = False
    """kiln convert writes only config.json, no weights (refused in a build file, which builds an engine)."""

    def __post_init__(self):
        require_positive("ConvertConfig", tp_size=self.tp_size, pp_size=self.pp_size, workers=self.workers,
                         group_size=self.group_size)
        reject_unsupported(self, ["ammo_quant_ckpt_path", "dataset_cache_dir"],
                           "Kiln calibrates on its own text; import quantized models as AWQ/GPTQ HF checkpoints")
        reject_unsupported(self, ["disable_weight_only_quant_plugin"], "Kiln has one weight-only kernel path")
        reject_unsupported(self, ["meta_ckpt_dir"], "Meta checkpoints are not supported; convert the HF model")
        reject_unsupported(self, ["load_model_on_cpu"], "Kiln converts on the host")
        require_positive("ConvertConfig", calib_size=self.calib_size)
        if self.round_to_nearest and not self._searched():
            raise ValueError("ConvertConfig: round_to_nearest applies to modes whose weights are searched (weight-only "
                             "int8, int4_gptq, int4_awq; use_fp8): int4 and smoothquant already round to nearest")
        if self.round_to_nearest and self.learned_rounding_steps:
            raise ValueError("ConvertConfig: round_to_nearest skips the calibrated searches, learned rounding among "
                             "them: drop learned_rounding_steps")
        if self.load_by_shard and self.merge_lora:
            raise ValueError("ConvertConfig: load_by_shard cannot merge_lora (the adapter is merged into the whole "
                             "model's weights)")
        if self.load_by_shard and self.quant_config().enabled:
            raise ValueError("ConvertConfig: load_by_shard cannot quantize (calibration needs the whole model)")
        self.quant_config()                       # validates the combination

    def quant_config(self) -> QuantConfig:
        """The QuantConfig these flags ask for; a clear error for combinations that make no sense."""
        chosen = [name for name, on in (("use_weight_only", self.use_weight_only), ("smoothquant", self.smoothquant is not None),
                                        ("use_fp8", self.use_fp8)) if on]
        if len(chosen) > 1:
            raise ValueError(f"ConvertConfig: choose one of use_weight_only, smoothquant, use_fp8 (got {', '.join(chosen)})")
        if self.int8_kv_cache and self.fp8_kv_cache:
            raise ValueError("ConvertConfig: int8_kv_cache and fp8_kv_cache exclude each other")
        algo = None
        if self.use_weight_only:
            algo = _weight_only_algo(self.weight_only_precision, self.per_group)
        elif self.smoothquant is not None:
            if not self.per_channel:
                raise ValueError("ConvertConfig: smoothquant needs per_channel (per-tensor int8 weights are not supported)")
            algo = "W8A8_SQ_PER_CHANNEL_PER_TOKEN" if self.per_token else "W8A8_SQ_PER_CHANNEL"
        elif self.use_fp8:
            algo = "FP8_PER_CHANNEL_PER_TOKEN" if self.fp8_per_token else "FP8"
        elif self.per_token or self.per_channel or self.per_group or self.fp8_per_token:
            raise ValueError("ConvertConfig: per_token/per_channel/per_group/fp8_per_token only go with a quantization mode")
        kv = "INT8" if self.int8_kv_cache else "FP8" if self.fp8_kv_cache else None
        return QuantConfig(quant_algo=algo, kv_cache_quant_algo=kv, group_size=self.group_size,
                           smoothquant_val=0.5 if self.smoothquant is None else self.smoothquant,
                           exclude_modules=excluded_modules(self.quantize_lm_head),
                           learned_rounding_steps=self.learned_rounding_steps)

    def _searched(self) -> bool:
        """A mode whose weights kiln convert rounds by a calibrated search (GPTQ, AWQ) unless round_to_nearest."""
        return self.use_fp8 or (self.use_weight_only and self.weight_only_precision != "int4")

    def parallel_fields(self) -> dict:
        """The PretrainedConfig fields these flags set for a sharded checkpoint."""
        return dict(use_parallel_embedding=self.use_parallel_embedding, embedding_sharding_dim=self.embedding_sharding_dim,
                    moe_tp_mode=self.moe_tp_mode)

    def check_against(self, config: PretrainedConfig, source: str) -> None:
        """Every shape field given here must agree with the model's own config."""
        for src, dst in SHAPE_FIELDS.items():
            given, actual = getattr(self, src), getattr(config, dst)
            if given is not None and given != actual:
                raise ValueError(f"checkpoint.{src}={given!r} disagrees with the model's {dst}={actual!r} "
                                 f"({source}); correct it or remove the key")

    def random_model_config(self, dtype: str) -> PretrainedConfig:
        """The PretrainedConfig of a random-weight model described by the shape fields (no model_dir)."""
        if self.load_by_shard:
            raise ValueError("load_by_shard reads a model directory a tensor at a time; a random-weight model "
                             "(no model directory) has none: remove it or give the model directory")
        for src in ("vocab_size", "n_layer", "n_head", "n_embd", "inter_size"):
            if getattr(self, src) is None:
                raise ValueError(f"without a model directory, checkpoint.{src} is needed to describe the model")
        values = {dst: getattr(self, src) for src, dst in SHAPE_FIELDS.items() if getattr(self, src) is not None}
        architecture = "MixtralForCausalLM" if values.get("moe_num_experts") else "LlamaForCausalLM"
        return PretrainedConfig(architecture=architecture, dtype="float32" if dtype == "auto" else dtype, **values)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "checkpoint") -> "ConvertConfig":
        return from_dict(cls, data, where)


def _weight_only_algo(precision: str, per_group: bool) -> str:
    algos = {"int8": "W8A16", "int4": "W4A16", "int4_gptq": "W4A16_GPTQ", "int4_awq": "W4A16_AWQ"}
    if precision not in algos:
        raise ValueError(f"ConvertConfig.weight_only_precision={precision!r} is not one of {', '.join(algos)}")
    if precision in ("int4_gptq", "int4_awq") and not per_group:
        raise ValueError(f"ConvertConfig: weight_only_precision={precision} quantizes per group: add per_group")
    if per_group and precision in ("int8", "int4"):
        raise ValueError(f"ConvertConfig: per_group goes with int4_gptq or int4_awq, not {precision}")
    return algos[precision]
