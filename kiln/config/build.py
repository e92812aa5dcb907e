"""BuildConfig and its parts: every field of the seed's `build:` section, validated."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from .fields import from_dict, reject_unsupported, require, require_choice, require_positive, require_whole, to_dict

DTYPE_CHOICES = ("auto", "disable", "float32", "bfloat16", "float16")


@dataclass
class PluginConfig:
    """Kernel choices of the engine (named after trtllm-build's plugin flags)."""

    gemm_plugin: str = "auto"
    """GEMM precision: auto or the model's dtype (the builder refuses any other). Kiln's GEMMs always compute in
    the model's dtype through its own kernels; disable (TensorRT's non-plugin GEMMs) is refused: there is no
    other GEMM path to fall back to."""
    gpt_attention_plugin: str = "auto"
    """Attention precision: auto or the model's dtype (the builder refuses any other); Kiln's attention always
    computes in the model's dtype."""
    context_fmha: bool = True
    """Fused attention for context (prompt) tokens; off uses the reference implementation everywhere."""
    remove_input_padding: bool = True
    """Pack the tokens of a batch without padding. Kiln always packs; False is rejected."""
    paged_kv_cache: bool = True
    """Keep the KV cache in fixed-size blocks. Kiln always pages its cache; False is rejected."""
    tokens_per_block: int = 32
    """Tokens per KV-cache block (a power of two)."""
    use_paged_context_fmha: bool = True
    """Context attention reads earlier tokens from the paged cache (what block reuse and chunked context need).
    Kiln's context attention always does (kiln/kernels: reference.paged_attention and the Triton kernel read the
    keys through the block table), so False is refused."""
    multi_block_mode: bool = True
    """Split generation attention along the sequence (512 tokens per program) so long contexts use the whole
    GPU; off, one program covers a sequence's whole cache."""
    use_custom_all_reduce: bool = False
    """Tensor parallelism on GPUs of one host: small all-reduces (decode steps) run as one kernel that reads the
    peers' buffers over NVLink (PyTorch symmetric memory), larger ones through NCCL."""
    use_fp8_all_reduce: bool = False
    """All-reduce in FP8."""
    use_fp8_cast_plugin: bool = False
    """FP8 cast kernel."""
    use_async_malloc: bool = False
    """Stream-ordered memory allocation."""
    use_fp8_context_fmha: bool = False
    """Prompt (context) attention on the FP8 tensor cores: in steps with prompt tokens each query row is rounded to
    e4m3 with its own scale and multiplied by the FP8 cache's keys as stored; P·V stays 16-bit. Needs an FP8 KV
    cache (kv_cache_quant_algo FP8) and a GPU with FP8 tensor cores (compute capability 8.9+); the CPU computes
    the same rounding."""
    fp8_fast_accumulation: bool = True
    """FP8 GEMMs (FP8 quantization, on GPUs) accumulate at the tensor cores' full rate without periodic promotion to
    float32 (as FBGEMM's FP8 inference GEMMs do), a sixth more FP8 throughput; off for
    exact float32 accumulation."""
    lora_plugin: str | None = None
    """Set (auto, or the model's dtype: the builder refuses any other): the engine reserves its LoRA adapter slots
    (LoraCacheConfig.max_loras of rank lora_config.max_lora_rank) when it loads, before its KV cache, and captures
    CUDA graphs with the batched LoRA products, so decode steps with adapters replay graphs too. Engines with stored
    adapters (lora_config.lora_dir) do so as well. Any other engine still serves adapters, allocating the slots when
    the first one is asked for and running adapter steps without graphs."""
    programmatic_dependent_launch: bool = True
    """On sm_90+ GPUs each kernel may start while the one before it finishes (it waits for its inputs in the
    kernel), inside CUDA graphs too; off for plain launches. Kiln's own flag: TensorRT-LLM has no such plugin."""
    cpu_kernels: str = "fast"
    """On the CPU: fast runs int8/int4 layers on PyTorch's packed CPU kernels with bf16 activations; reference keeps
    every layer on the exact reference products (as docs/quantization.md's accuracy tables are measured). Kiln's own
    flag."""

    def __post_init__(self):
        if self.gemm_plugin == "disable":
            raise ValueError("PluginConfig.gemm_plugin='disable' is not supported by Kiln: every GEMM runs through "
                             "Kiln's own kernels in the model's dtype; use auto (or the model's dtype)")
        require_choice("PluginConfig", "gemm_plugin", self.gemm_plugin, DTYPE_CHOICES)
        require_choice("PluginConfig", "gpt_attention_plugin", self.gpt_attention_plugin, DTYPE_CHOICES[:1] + DTYPE_CHOICES[2:])
        require_positive("PluginConfig", tokens_per_block=self.tokens_per_block)
        require(self.tokens_per_block & (self.tokens_per_block - 1) == 0,
                f"PluginConfig.tokens_per_block={self.tokens_per_block} must be a power of two")
        reject_unsupported(self, ["remove_input_padding", "paged_kv_cache"], "Kiln always uses packed, paged inputs")
        reject_unsupported(self, ["use_paged_context_fmha"],
                           "Kiln's context attention always reads earlier tokens from the paged cache")
        reject_unsupported(self, ["use_fp8_cast_plugin"],
                           "Kiln's FP8 casts are fused into the kernels that make the values (norms, SiLU)")
        reject_unsupported(self, ["use_fp8_all_reduce"], "Kiln all-reduces in the model's dtype")
        reject_unsupported(self, ["use_async_malloc"], "Kiln uses PyTorch's caching allocator")
        if self.lora_plugin is not None:
            require_choice("PluginConfig", "lora_plugin", self.lora_plugin, DTYPE_CHOICES[:1] + DTYPE_CHOICES[2:])
        require_choice("PluginConfig", "cpu_kernels", self.cpu_kernels, ("fast", "reference"))


LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# TensorRT-LLM's names of the same projections (its lora_target_modules values)
TRTLLM_LORA_MODULES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_dense": "o_proj",
                       "mlp_h_to_4h": "gate_proj", "mlp_gate": "up_proj", "mlp_4h_to_h": "down_proj"}


@dataclass
class LoraConfig:
    """LoRA adapters the engine serves (Hugging Face PEFT adapters, chosen per request at run time)."""

    lora_dir: list[str] = field(default_factory=list)
    """Directories of Hugging Face PEFT adapters to store with the engine, checked against the model at build; each
    is then served by its directory's name (LoRARequest(name), no path needed). Other adapters can still be given
    per request with their path."""
    lora_target_modules: list[str] = field(default_factory=list)
    """Projections adapters may target: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (or
    TensorRT-LLM's attn_q, attn_k, attn_v, attn_dense, mlp_h_to_4h, mlp_gate, mlp_4h_to_h); empty: all seven. An
    adapter with weights on another projection is refused."""
    lora_ckpt_source: str = "hf"
    """Format of the LoRA checkpoints: hf (Hugging Face PEFT: adapter_config.json + adapter_model.safetensors or
    .bin); nemo is refused."""
    max_lora_rank: int = 64
    """Largest adapter rank the engine accepts; an adapter of a higher rank is refused."""

    def __post_init__(self):
        require_choice("LoraConfig", "lora_ckpt_source", self.lora_ckpt_source, ("hf", "nemo"))
        require_positive("LoraConfig", max_lora_rank=self.max_lora_rank)
        known = LORA_TARGET_MODULES + tuple(TRTLLM_LORA_MODULES)
        for name in self.lora_target_modules:
            require(name in known, f"LoraConfig.lora_target_modules: {name!r} is not one of {', '.join(known)}")
        reject_unsupported(self, ["lora_ckpt_source"], "NeMo adapters are not read; Hugging Face PEFT adapters are")
        names = [PurePath(d).name for d in self.lora_dir]
        twice = sorted(n for n in names if names.count(n) > 1)
        require(not twice, f"LoraConfig.lora_dir: two adapter directories have the same name ({twice[:1]}); an "
                "adapter is served by its directory's name")

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The projections adapters may target, by their Hugging Face names (all seven when none are listed)."""
        if not self.lora_target_modules:
            return LORA_TARGET_MODULES
        return tuple(dict.fromkeys(TRTLLM_LORA_MODULES.get(m, m) for m in self.lora_target_modules))


@dataclass
class AutoParallelConfig:
    """Automatic choice of tensor/pipeline parallelism."""

    enabled: bool = False
    """Let the builder split an unsharded model over tp_size × pp_size GPUs as it sees fit (it says why)."""
    tp_size: int = 1
    """With enabled: tp_size × pp_size is the number of GPUs the builder splits the model over."""
    pp_size: int = 1
    """With enabled: see tp_size."""
    max_memory_MB: int = 80000
    """With enabled: memory per GPU for the model's weights; a split that needs more is refused."""
    max_dram_memory_MB: int = 30000
    """Host memory available per device."""
    compile_max_memory_MB: int = 17000
    """GPU memory available while building."""
    compile_max_dram_memory_MB: int = 8000
    """Host memory available while building."""
    debug_mode: bool = False
    """With enabled: print every tp × pp candidate of the search, whether it shards and fits, and why the chosen
    one won."""

    def __post_init__(self):
        require_positive("AutoParallelConfig", tp_size=self.tp_size, pp_size=self.pp_size,
                         max_memory_MB=self.max_memory_MB)
        require(self.enabled or self.world_size == 1,
                "AutoParallelConfig: tp_size/pp_size count the GPUs for enabled: true; set enabled or leave them 1")
        require(self.enabled or (self.max_memory_MB == 80000 and not self.debug_mode),
                "AutoParallelConfig: max_memory_MB and debug_mode apply to the search of enabled: true; set enabled "
                "or leave them at their defaults")
        reject_unsupported(self, ["max_dram_memory_MB", "compile_max_memory_MB", "compile_max_dram_memory_MB"],
                           "Kiln's builder sizes itself; only max_memory_MB limits the choice")

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size


@dataclass
class BuildConfig:
    """How an engine is built: its limits (batch, lengths, beams) and kernel choices."""

    max_input_len: int = 256
    """Longest prompt, in tokens."""
    max_output_len: int | None = None
    """Most tokens generated per request (LLM refuses a larger max_new_tokens); None means
    max_seq_len - max_input_len (256 when both are None)."""
    max_seq_len: int | None = None
    """Longest prompt + output; None means max_input_len + max_output_len. Given with both, it may be less than
    their sum: every request then keeps all three limits."""
    max_batch_size: int = 8
    """Most requests in flight at once."""
    max_beam_width: int = 1
    """Most beams a request may ask for."""
    max_num_tokens: int | None = None
    """Most tokens (prompt chunks + generated) processed in one step; None picks min(8192,
    max_batch_size * max_input_len), at least max_input_len. Below max_input_len, LLM needs
    enable_chunked_context."""
    opt_num_tokens: int | None = None
    """Token count to optimise kernels for."""
    max_prompt_embedding_table_size: int = 0
    """Most rows of a request's prompt embedding table (prompt tuning, or embeddings made elsewhere: prompt token id
    vocab_size + i stands for row i of the request's table); 0 refuses prompt tables."""
    gather_context_logits: bool = False
    """Return the logits of every prompt position."""
    gather_generation_logits: bool = False
    """Return the logits of every generated position."""
    strongly_typed: bool = True
    """Kept for trtllm-build compatibility: Kiln engines always keep the checkpoint's dtypes, so both values
    build the same engine (a note is printed when it is False)."""
    builder_opt: int | None = None
    """Builder optimisation level."""
    profiling_verbosity: str = "layer_names_only"
    """Detail of --visualize_network: layer_names_only (names), detailed (names, shapes, dtypes) or none;
    detailed without visualize_network is refused (it has nothing to detail)."""
    enable_debug_output: bool = False
    """Keep intermediate tensors for debugging."""
    max_draft_len: int = 0
    """Draft tokens a sequence may have verified per step (speculative decoding, LLM's speculative_config); 0:
    an engine loaded from disk runs without speculation (an LLM that builds its engine sets it from its
    speculative_config)."""
    use_refit: bool = False
    """Build a refittable engine: its weights may be replaced in place by a model of the same architecture and
    shapes (LLM.update_weights, Engine.refit) without a rebuild; refit refuses an engine built without it, as
    TensorRT-LLM does. Stored (and hashed) in the engine's config.json. On a GPU its quantized layers take layouts
    that follow from their shapes alone (int4 group scales stay float32 where fp16 would hold them)."""
    input_timing_cache: str | None = None
    """A .tar of compiled GPU kernels (an earlier output_timing_cache) to start from when building on a GPU."""
    output_timing_cache: str | None = None
    """Also write the engine's compiled GPU kernels to this .tar (building on a GPU)."""
    lora_config: LoraConfig = field(default_factory=LoraConfig)
    """LoRA settings."""
    auto_parallel_config: AutoParallelConfig = field(default_factory=AutoParallelConfig)
    """Automatic parallelism settings."""
    weight_sparsity: bool = False
    """Run the decoder's projections on the 2:4 sparse path (sparse tensor cores on GPUs of compute capability 8.0+
    in fp16/bf16; CSR products on the CPU in float32): their weights must be 2:4 sparse (kiln convert --prune_2_4),
    float, and not refittable; the build checks each."""
    plugin_config: PluginConfig = field(default_factory=PluginConfig)
    """Kernel choices."""
    max_encoder_input_len: int = 1024
    """Longest encoder input (encoder-decoder models only)."""
    use_fused_mlp: bool = True
    """Kept for trtllm-build compatibility: Kiln always fuses the gate and up projections, so both values
    build the same engine (a note is printed when it is False)."""
    dry_run: bool = False
    """Validate everything and run every build step, but write nothing."""
    visualize_network: bool = False
    """Write the module graph as text (network.txt) next to the engine."""

    def __post_init__(self):
        self.lora_config = _as(LoraConfig, self.lora_config, "build.lora_config")
        self.auto_parallel_config = _as(AutoParallelConfig, self.auto_parallel_config, "build.auto_parallel_config")
        self.plugin_config = _as(PluginConfig, self.plugin_config, "build.plugin_config")
        self._resolve_lengths()
        self._validate()

    def _resolve_lengths(self):
        if self.max_seq_len is None:
            self.max_seq_len = self.max_input_len + (256 if self.max_output_len is None else self.max_output_len)
        if self.max_output_len is None:
            self.max_output_len = self.max_seq_len - self.max_input_len
        if self.max_num_tokens is None:
            self.max_num_tokens = max(self.max_input_len, min(8192, self.max_batch_size * self.max_input_len))

    def _validate(self):
        owner = "BuildConfig"
        require_positive(owner, max_input_len=self.max_input_len, max_output_len=self.max_output_len,
                         max_seq_len=self.max_seq_len, max_batch_size=self.max_batch_size,
                         max_beam_width=self.max_beam_width, max_num_tokens=self.max_num_tokens)
        require(self.max_seq_len <= self.max_input_len + self.max_output_len,
                f"BuildConfig: max_seq_len={self.max_seq_len} exceeds max_input_len={self.max_input_len} + "
                f"max_output_len={self.max_output_len}: no request could use it; give only one of max_seq_len "
                "and max_output_len")
        for name in ("max_input_len", "max_output_len"):
            require(getattr(self, name) < self.max_seq_len,
                    f"BuildConfig.{name}={getattr(self, name)} must be below max_seq_len={self.max_seq_len} "
                    "(a request has at least one prompt token and generates at least one)")
        require_choice(owner, "profiling_verbosity", self.profiling_verbosity, ("layer_names_only", "detailed", "none"))
        require(self.profiling_verbosity != "detailed" or self.visualize_network,
                "BuildConfig.profiling_verbosity='detailed' only details visualize_network's network.txt: set "
                "visualize_network, or leave profiling_verbosity at layer_names_only")
        reject_unsupported(self, ["opt_num_tokens", "builder_opt"], "Kiln has no tuning profiles yet")
        require_whole(owner, max_prompt_embedding_table_size=self.max_prompt_embedding_table_size,
                      max_draft_len=self.max_draft_len)
        reject_unsupported(self, ["enable_debug_output"], "debug outputs are not implemented yet")
        reject_unsupported(self, ["max_encoder_input_len"], "encoder-decoder models are not supported")

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "build") -> "BuildConfig":
        return from_dict(cls, data, where)

    def engine_fields(self) -> dict[str, Any]:
        """The fields that shape the engine (hashed into its manifest); switches without effect are left out."""
        data = self.to_dict()
        for name in ("dry_run", "visualize_network", "input_timing_cache", "output_timing_cache",
                     "strongly_typed", "use_fused_mlp", "profiling_verbosity"):
            data.pop(name)
        return data


def _as(cls, value, where: str):
    if value is None:
        return cls()
    if isinstance(value, dict):
        return from_dict(cls, value, where)
    require(isinstance(value, cls), f"{where} must be a {cls.__name__} or a dict, got {type(value).__name__}")
    return value


