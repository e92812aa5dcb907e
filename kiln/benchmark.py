"""`kiln bench`: throughput and latency of an engine, beside the hardware's limits (modelled on trtllm-bench).

Engines come from a directory, or are built on the spot with random weights of a named real shape
(`llama-3.1-8b`, `llama-3.1-70b`, `mixtral-8x7b`, `smollm2-135m`), like vLLM's dummy weights.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from kiln.builder import Engine, build
from kiln.checkpoint.lazy import meta_tensors
from kiln.config import LORA_TARGET_MODULES, BuildConfig, KvCacheConfig, Mapping, PretrainedConfig
from kiln.runtime.sampling import SamplingConfig

LLAMA31_ROPE = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
SHAPES: dict[str, dict] = {
    "llama-3.1-8b": dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, norm_epsilon=1e-5,
                         rotary_base=500000.0, rope_scaling=LLAMA31_ROPE, max_position_embeddings=131072),
    "llama-3.1-70b": dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, norm_epsilon=1e-5,
                          rotary_base=500000.0, rope_scaling=LLAMA31_ROPE, max_position_embeddings=131072),
    "mixtral-8x7b": dict(architecture="MixtralForCausalLM", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, norm_epsilon=1e-5,
                         rotary_base=1e6, max_position_embeddings=32768, moe_num_experts=8, moe_top_k=2),
    "smollm2-135m": dict(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, norm_epsilon=1e-5,
                         rotary_base=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
}


def shape_config(name: str, dtype: str) -> PretrainedConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    return PretrainedConfig(**SHAPES[name], dtype=dtype)


def choose_device(device: str | None) -> torch.device:
    """The device to benchmark on: `device`, or a CUDA GPU when one is visible and the CPU otherwise."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; use cpu or cuda") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch sees no CUDA GPU here; leave --device out (or give cpu) to "
                         "benchmark on the CPU")
    return chosen


def default_dtype(device: torch.device) -> str:
    """bfloat16 on GPUs; float32 on the CPU, whose float32 products are the fast ones."""
    return "bfloat16" if device.type == "cuda" else "float32"


def random_engine(name: str, dtype: str, build_config: BuildConfig, device: str = "cuda", quiet: bool = True,
                  quant_config=None, tp_size: int = 1, pp_size: int = 1, rank: int = 0) -> Engine:
    """An engine of a real model's shape with random weights, made on `device` in seconds (quantized first when
    `quant_config` asks, by round to nearest: AWQ's and GPTQ's searches mean nothing on random weights; static
    scales are calibrated on random tokens). With tp_size × pp_size > 1 it is
    `rank`'s shard, made directly in its local shapes, and the other ranks make theirs the same way."""
    from kiln.models import LlamaForCausalLM

    config, world = shape_config(name, dtype), tp_size * pp_size
    if world > 1:
        if quant_config is not None and quant_config.enabled:
            raise ValueError("kiln bench: --quant_algo/--kv_cache_quant_algo with tp_size/pp_size > 1 is not "
                             "supported yet (quantize and shard a checkpoint with kiln convert, then --engine_dir)")
        config = dataclasses.replace(config, mapping=Mapping(world, rank, tp_size, pp_size))
    model = LlamaForCausalLM.random(config, seed=rank, device=device, lazy=True)   # made a layer at a time
    if quant_config is not None and quant_config.enabled:
        from kiln.quantization import quantize_model
        model = quantize_model(model, quant_config, calib_size=4, quiet=quiet, round_to_nearest=True)
    engine = build(model, build_config, quiet=quiet)
    if world > 1:
        engine.rank_loader = functools.partial(_random_rank, name, dtype, build_config, tp_size, pp_size)
    return engine


def _random_rank(name: str, dtype: str, build_config: BuildConfig, tp_size: int, pp_size: int, rank: int,
                 device) -> Engine:
    return random_engine(name, dtype, build_config, str(device), tp_size=tp_size, pp_size=pp_size, rank=rank)


@dataclass
class Hardware:
    """Measured ceilings of the device: copy bandwidth (bytes read + written) and dense GEMM rate."""

    name: str
    copy_bytes_per_s: float
    gemm_flops: float

    @classmethod
    def measure(cls, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> "Hardware":
        if device.type != "cuda":
            return cls("cpu", float("nan"), float("nan"))
        a = torch.randn(1 << 28, device=device, dtype=dtype)
        b = torch.empty_like(a)
        copy_s = _cuda_time(lambda: b.copy_(a), 10)
        del a, b
        x = torch.randn(8192, 8192, device=device, dtype=dtype)
        y = torch.randn_like(x)
        gemm_s = _cuda_time(lambda: x @ y, 10)
        del x, y
        torch.cuda.empty_cache()
        return cls(torch.cuda.get_device_name(device), 2 * (1 << 28) * 2 / copy_s, 2 * 8192 ** 3 / gemm_s)


def _cuda_time(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def graph_seconds(launches, repeats: int | None = None) -> float:
    """GPU seconds per launch: the launches (each on its own weight copy, so that L2 holds none of them) captured in
    one CUDA graph and replayed, as the engine's decode steps run. repeats None: as many replays as fit ~20 ms (at
    most 10), judged by a first one."""
    for launch in launches:
        launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    if repeats is None:
        repeats = max(1, min(10, int(0.02 / max(start.elapsed_time(end) / 1e3, 1e-6))))
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) / 1e3 / (repeats * len(launches))


@dataclass
class BenchResult:
    mode: str
    model: str
    dtype: str
    num_requests: int
    input_len: int
    output_len: int
    elapsed_s: float
    output_tokens: int
    output_tok_s: float
    requests_s: float
    ttft_ms: dict = field(default_factory=dict)
    tpot_ms: dict = field(default_factory=dict)
    peak_memory_gib: float = 0.0
    hardware_limit_pct: float | None = None
    limit_note: str = ""

    def table(self) -> str:
        rows = [("mode", self.mode), ("model", f"{self.model} ({self.dtype})"),
                ("requests", f"{self.num_requests} × {self.input_len} in / {self.output_len} out"),
                ("output tok/s", f"{self.output_tok_s:,.1f}"), ("requests/s", f"{self.requests_s:.2f}"),
                ("TTFT ms p50/p90/p99", "/".join(f"{self.ttft_ms.get(p, float('nan')):.1f}" for p in ("p50", "p90", "p99"))),
                ("TPOT ms p50/p90/p99", "/".join(f"{self.tpot_ms.get(p, float('nan')):.2f}" for p in ("p50", "p90", "p99"))),
                ("peak memory GiB", f"{self.peak_memory_gib:.1f}")]
        if self.hardware_limit_pct is not None:
            rows.append(("% of hardware limit", f"{self.hardware_limit_pct:.1f}% ({self.limit_note})"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": statistics.fmean(values)}


def random_prompts(num: int, input_len: int, vocab: int, seed: int = 0, spread: float = 0.0) -> list[list[int]]:
    """Random token-id prompts; with spread > 0, lengths are drawn uniformly within ±spread of input_len."""
    rng = random.Random(seed)
    lengths = [max(1, round(input_len * (1 + rng.uniform(-spread, spread)))) for _ in range(num)]
    return [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]


def run_requests(llm, prompts: list[list[int]], output_len: int, request_rate: float | None = None, seed: int = 0,
                 loras: list | None = None):
    """Submit every prompt (all at once, or at a Poisson request rate; prompt i under the LoRA adapter
    loras[i % len(loras)] where given) and wait for all; returns outputs, seconds."""
    sampling = SamplingConfig(max_new_tokens=output_len, min_tokens=output_len, end_id=-1)
    rng = random.Random(seed)
    start = time.perf_counter()
    results = []
    for i, prompt in enumerate(prompts):
        results.append(llm.generate_async(prompt, sampling, lora_request=loras[i % len(loras)] if loras else None))
        if request_rate:
            time.sleep(rng.expovariate(request_rate))
    outputs = [r.result() for r in results]
    return outputs, time.perf_counter() - start


def warm_up(llm, input_len: int, output_len: int, vocab: int, max_batch: int, num_requests: int | None = None) -> None:
    """Run the throughput workload's shapes once before measuring it — a full batch of prompts, then a second
    wave whose prompts join sequences still decoding (at most num_requests prompts, at most 8 new tokens each) — so
    that kernel compilation (Triton specialises on the sizes it sees) and library heuristics for new shapes stay out
    of the measured time."""
    count = min(num_requests or max_batch * 2, max_batch + max_batch // 2)
    run_requests(llm, random_prompts(count, input_len, vocab, seed=1), min(output_len, 8))


def summarize(mode: str, model: str, dtype: str, outputs, elapsed: float, input_len: int, output_len: int) -> BenchResult:
    tokens = sum(len(o.token_ids) for o in outputs)
    ttft = [o.metrics.time_to_first_token * 1e3 for o in outputs if o.metrics.time_to_first_token is not None]
    tpot = [o.metrics.time_per_output_token * 1e3 for o in outputs if o.metrics.time_per_output_token is not None]
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    return BenchResult(mode, model, dtype, len(outputs), input_len, output_len, elapsed, tokens, tokens / elapsed,
                       len(outputs) / elapsed, _percentiles(ttft), _percentiles(tpot), peak)


def active_fraction(name: str, config: PretrainedConfig) -> float:
    """The share of a weight one token reads: a routed expert's tensors are read for top_k of num_experts experts
    (each token's own), every other tensor whole."""
    if config.moe_num_experts and ".moe." in name and ".router." not in name:
        return config.moe_top_k / config.moe_num_experts
    return 1.0


def decode_limit_pct(result: BenchResult, engine: Engine, hw: Hardware) -> None:
    """Batch-1 decode against weight streaming: every step reads its active weights once (all of a dense model's;
    of an MoE, the top_k experts a token is routed to) at the measured copy rate (bytes read + written per second,
    the rate the targets are stated against)."""
    config = engine.pretrained_config
    weight_bytes = sum(t.numel() * t.element_size() * active_fraction(name, config)
                       for name, t in meta_tensors(engine.weights[0]).items())
    best_step_s = weight_bytes / hw.copy_bytes_per_s
    tpot = result.tpot_ms.get("p50")
    if tpot and hw.copy_bytes_per_s == hw.copy_bytes_per_s:       # NaN on the CPU: no limit to compare with
        result.hardware_limit_pct = 100 * best_step_s / (tpot / 1e3)
        active = " active" if config.moe_num_experts else ""
        result.limit_note = (f"{1 / best_step_s:.0f} tok/s:{active} weights {weight_bytes / 1e9:.1f} GB per step at "
                             f"the {hw.copy_bytes_per_s / 1e12:.2f} TB/s measured copy rate")


def throughput_limit_pct(result: BenchResult, engine: Engine, hw: Hardware) -> None:
    """Throughput against dense GEMM: 2 FLOPs per active weight per token (prompt and output tokens; an MoE token
    multiplies by its top_k experts only)."""
    if hw.gemm_flops != hw.gemm_flops:
        return
    config = engine.pretrained_config
    params = sum(t.numel() * active_fraction(name, config) for name, t in meta_tensors(engine.weights[0]).items()
                 if "embed_tokens" not in name or config.tie_word_embeddings)
    flops = 2 * params * result.num_requests * (result.input_len + result.output_len)
    result.hardware_limit_pct = 100 * (flops / hw.gemm_flops) / result.elapsed_s
    result.limit_note = f"{flops / 1e15:.2f} PFLOP at {hw.gemm_flops / 1e12:.0f} TFLOP/s measured GEMM"


def hf_baseline(model: str, dtype: str, batch: int, input_len: int, output_len: int, device: str = "cuda") -> dict:
    """transformers generate on the same shape (random weights, eager, dynamic cache), greedy."""
    import transformers

    shape = SHAPES[model]
    cls = transformers.MixtralConfig if shape["architecture"] == "MixtralForCausalLM" else transformers.LlamaConfig
    kwargs = dict(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
                  intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_hidden_layers"],
                  num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
                  max_position_embeddings=min(shape["max_position_embeddings"], 8192), rms_norm_eps=shape["norm_epsilon"])
    if shape.get("moe_num_experts"):
        kwargs.update(num_local_experts=shape["moe_num_experts"], num_experts_per_tok=shape["moe_top_k"])
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(cls(**kwargs)).to(getattr(torch, dtype)).eval()
    ids = torch.randint(10, shape["vocab_size"], (batch, input_len), device=device)

    def gen(n):
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)
        if ids.is_cuda:
            torch.cuda.synchronize()

    gen(4)
    start = time.perf_counter()
    gen(output_len)
    elapsed = time.perf_counter() - start
    del hf
    torch.cuda.empty_cache()
    return {"mode": "hf_baseline", "model": model, "batch": batch, "input_len": input_len, "output_len": output_len,
            "output_tok_s": batch * output_len / elapsed, "elapsed_s": elapsed}


def random_adapters(config: PretrainedConfig, root, count: int, rank: int,
                    targets: tuple[str, ...] = LORA_TARGET_MODULES, seed: int = 0) -> list:
    """`count` Hugging Face PEFT adapters of `rank` on `targets` of every layer of a model of `config`'s shape,
    with random A and B (made on the GPU where there is one), written under `root`; returns their LoRARequests."""
    from pathlib import Path

    from safetensors.torch import save_file

    from kiln.checkpoint.lora import HF_BLOCK, base_shape
    from kiln.runtime.request import LoRARequest

    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(seed)
    requests = []
    for i in range(count):
        path = Path(root) / f"adapter{i}"
        path.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for target in targets:
                out, inp = base_shape(target, config)
                key = f"base_model.model.model.layers.{layer}.{HF_BLOCK[target]}.{target}"
                a = torch.randn((rank, inp), generator=generator, device=device) / inp ** 0.5
                b = torch.randn((out, rank), generator=generator, device=device) * 0.01
                tensors[f"{key}.lora_A.weight"] = a.to(getattr(torch, config.dtype)).cpu()
                tensors[f"{key}.lora_B.weight"] = b.to(getattr(torch, config.dtype)).cpu()
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets)}))
        requests.append(LoRARequest(path.name, str(path)))
    return requests


def to_json(result: BenchResult) -> str:
    return json.dumps(asdict(result))


def default_bench_build(mode: str, input_len: int, output_len: int, max_batch_size: int | None) -> BuildConfig:
    seq = input_len + output_len
    if mode == "latency":
        return BuildConfig(max_batch_size=max_batch_size or 1, max_input_len=input_len, max_seq_len=seq)
    batch = max_batch_size or 512
    return BuildConfig(max_batch_size=batch, max_input_len=input_len, max_seq_len=seq,
                       max_num_tokens=max(input_len, min(16384, batch * input_len)))


def default_kv_config() -> KvCacheConfig:
    return KvCacheConfig(free_gpu_memory_fraction=0.9)


class AcceptanceDrafter:
    """A drafter for random-weight shapes, whose own drafts would never be accepted: it proposes the model's
    greedy continuation of each prompt (recorded by a run without drafts), each token replaced by another with
    probability 1 − alpha, so the acceptance rate is alpha per token and the mechanism's speed can be measured."""

    def __init__(self, continuations: dict[tuple, list[int]], alpha: float, max_draft_len: int, vocab: int,
                 seed: int = 0):
        self.continuations, self.alpha, self.max_draft_len, self.vocab = continuations, alpha, max_draft_len, vocab
        self.rng = random.Random(seed)

    def propose(self, batch) -> None:
        for request, seq, k in batch:
            at = seq.num_output_tokens
            drafts = self.continuations[tuple(request.prompt_token_ids)][at:at + k]
            seq.draft_ids = [d if self.rng.random() < self.alpha else (d + 1 + self.rng.randrange(self.vocab - 1))
                             % self.vocab for d in drafts]
            seq.draft_probs = None

    def release(self, request) -> None:
        pass


def speculative_runs(llm, prompts: list[list[int]], output_len: int, alphas: list[float], max_draft_len: int):
    """Greedy requests without drafts, then with an AcceptanceDrafter at each alpha; yields (alpha or None,
    outputs, seconds, share of tokens equal to the run without drafts). The drafter proposes the continuations of
    a first untimed run with every draft right (alpha 1): the tokens of the verifying steps' own kernels, which in
    bf16 can differ from one-token steps' where two logits nearly tie (random weights have many such ties; real
    models, and float32, give the same tokens — the tests check it)."""
    outputs, seconds = run_requests(llm, prompts, output_len)
    yield None, outputs, seconds, 1.0
    vocab = llm.engine.pretrained_config.vocab_size
    table = lambda outs: {tuple(o.prompt_token_ids): o.token_ids for o in outs}  # noqa: E731
    try:
        llm.core.set_drafter(AcceptanceDrafter(table(outputs), 1.0, max_draft_len, vocab))
        continuations = table(run_requests(llm, prompts, output_len)[0])
        for alpha in alphas:
            llm.core.set_drafter(AcceptanceDrafter(continuations, alpha, max_draft_len, vocab))
            drafted, seconds = run_requests(llm, prompts, output_len)
            same = [a == b for x, y in zip(drafted, outputs) for a, b in zip(x.token_ids, y.token_ids)]
            yield alpha, drafted, seconds, sum(same) / max(1, len(same))
    finally:
        llm.core.set_drafter(None)
