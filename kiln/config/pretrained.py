"""PretrainedConfig: what a model is (shapes, activation, rotary embedding, MoE), independent of any build."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .fields import from_dict, require, require_choice, require_positive, to_dict
from .mapping import Mapping
from .quant import QuantConfig

DTYPES = ("float32", "bfloat16", "float16")
ROPE_SCALING_TYPES = ("linear", "llama3")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM")
INTEGER_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "moe_num_experts",
                  "moe_top_k")


def check_architecture(architecture) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}; Kiln supports {', '.join(SUPPORTED_ARCHITECTURES)}")


@dataclass
class PretrainedConfig:
    """The architecture and shapes of a decoder-only model, as stored in a Kiln checkpoint's config.json."""

    architecture: str
    """Model class name, e.g. LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM."""
    dtype: str
    """Weight and activation dtype: float32, bfloat16 or float16."""
    vocab_size: int
    """Number of tokens in the vocabulary (rows of the embedding and the LM head)."""
    hidden_size: int
    """Width of the residual stream."""
    num_hidden_layers: int
    """Number of decoder layers."""
    num_attention_heads: int
    """Query heads per layer."""
    intermediate_size: int
    """Width of the MLP (of each expert for MoE models)."""
    num_key_value_heads: int | None = None
    """Key/value heads (grouped-query attention); None means equal to num_attention_heads."""
    head_dim: int | None = None
    """Size of one attention head; None means hidden_size // num_attention_heads."""
    hidden_act: str = "silu"
    """MLP activation; the gated SiLU of the Llama family."""
    norm_epsilon: float = 1e-5
    """Epsilon of the RMSNorm layers."""
    rotary_base: float = 10000.0
    """Base (theta) of the rotary position embedding."""
    rope_scaling: dict[str, Any] | None = None
    """Rotary scaling: {"type": "linear", "factor": f} or Llama 3.1's {"type": "llama3", "factor",
    "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}; None for plain RoPE."""
    max_position_embeddings: int = 2048
    """Longest sequence (prompt + output) the model was trained for."""
    tie_word_embeddings: bool = False
    """The LM head reuses the token embedding matrix."""
    attention_bias: bool = False
    """The q/k/v projections have biases (Qwen2)."""
    dense_bias: bool = False
    """The attention output projection has a bias."""
    mlp_bias: bool = False
    """The MLP projections have biases."""
    sliding_window: int | None = None
    """Attend only to the last this-many tokens (Mistral v0.1); None for full attention."""
    moe_num_experts: int = 0
    """Experts per MoE layer (Mixtral: 8); 0 for a dense MLP."""
    moe_top_k: int = 0
    """Experts each token is routed to (Mixtral: 2)."""
    moe_renorm_mode: int = 1
    """1: the top-k routing weights are renormalised to sum to one (Mixtral); 0: plain softmax weights."""
    mapping: Mapping = field(default_factory=Mapping)
    """Tensor/pipeline parallel layout this checkpoint is sharded for."""
    use_parallel_embedding: bool = False
    """Split the embedding table across tensor-parallel ranks (otherwise every rank holds it whole)."""
    embedding_sharding_dim: int = 0
    """With use_parallel_embedding: split by vocabulary rows (0) or by hidden columns (1)."""
    moe_tp_mode: int = 0
    """Tensor parallelism of MoE experts: 0 divides the experts among ranks (expert parallel), 1 splits every
    expert's intermediate size (tensor parallel)."""
    quantization: QuantConfig = field(default_factory=QuantConfig)
    """Quantization applied to the weights and KV cache."""

    def __post_init__(self):
        if isinstance(self.mapping, dict):
            self.mapping = from_dict(Mapping, self.mapping, "pretrained_config.mapping")
        if isinstance(self.quantization, dict):
            self.quantization = from_dict(QuantConfig, self.quantization, "pretrained_config.quantization")
        for name in INTEGER_FIELDS:     # before any arithmetic on them (HF config.json values arrive unchecked)
            value = getattr(self, name)
            require(value is None or (isinstance(value, int) and not isinstance(value, bool)),
                    f"PretrainedConfig.{name} must be an integer, got {value!r}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            require(self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads == 0,
                    f"PretrainedConfig: hidden_size={self.hidden_size} is not divisible by "
                    f"num_attention_heads={self.num_attention_heads}; give head_dim")
            self.head_dim = self.hidden_size // self.num_attention_heads
        self._validate()

    def _validate(self):
        owner = "PretrainedConfig"
        check_architecture(self.architecture)
        require_choice(owner, "dtype", self.dtype, DTYPES)
        require_positive(owner, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                         num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                         num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                         intermediate_size=self.intermediate_size, norm_epsilon=self.norm_epsilon,
                         rotary_base=self.rotary_base, max_position_embeddings=self.max_position_embeddings,
                         sliding_window=self.sliding_window)
        require(self.num_attention_heads % self.num_key_value_heads == 0,
                f"{owner}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        require(self.head_dim % 2 == 0, f"{owner}.head_dim={self.head_dim} must be even for rotary embedding")
        require_choice(owner, "hidden_act", self.hidden_act, ("silu",))
        require_choice(owner, "moe_renorm_mode", self.moe_renorm_mode, (0, 1))
        require_choice(owner, "embedding_sharding_dim", self.embedding_sharding_dim, (0, 1))
        require_choice(owner, "moe_tp_mode", self.moe_tp_mode, (0, 1))
        if self.moe_num_experts:
            require(0 < self.moe_top_k <= self.moe_num_experts,
                    f"{owner}.moe_top_k={self.moe_top_k} must be in [1, moe_num_experts={self.moe_num_experts}]")
        if self.rope_scaling is not None:
            self._validate_rope_scaling()
        if self.is_moe:
            self._validate_moe_quantization()

    def _validate_moe_quantization(self):
        quant = self.quantization
        experts = quant.quantizes("moe.gate_up_proj") or quant.quantizes("moe.down_proj")
        require(not (experts and quant.quant_algo.startswith("W8A8")),
                f"PretrainedConfig: MoE experts take W8A16, W4A16*, FP8* or no weight quantization, not "
                f"{quant.quant_algo} (SmoothQuant; exclude_modules may leave the experts out)")
        require(not quant.learned_rounding_steps,
                "PretrainedConfig: learned_rounding_steps is not supported for MoE models; set it to 0")

    def _validate_rope_scaling(self):
        scaling = self.rope_scaling
        kind = scaling.get("type")
        require(kind in ROPE_SCALING_TYPES,
                f"PretrainedConfig.rope_scaling type {kind!r} is not supported; supported: {', '.join(ROPE_SCALING_TYPES)}")
        required = ["factor"] + (["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
                                 if kind == "llama3" else [])
        for key in required:
            require(key in scaling, f"PretrainedConfig.rope_scaling of type {kind!r} needs {key!r}")
        require_positive("PretrainedConfig.rope_scaling", **{k: scaling[k] for k in required})

    @property
    def is_moe(self) -> bool:
        return self.moe_num_experts > 0

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PretrainedConfig":
        return from_dict(cls, data, "pretrained_config")
