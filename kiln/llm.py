"""LLM: point it at an HF directory, a GGUF file, a Kiln checkpoint or an engine; it does what is missing."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence, Union

import torch

from kiln.builder import Engine, build, is_engine_dir
from kiln.checkpoint import is_checkpoint_dir, load_checkpoint_config, read_source_config
from kiln.config import BuildConfig, KvCacheConfig, PretrainedConfig
from kiln.models import PretrainedModel, model_class
from kiln.runtime.engine_core import EngineCore
from kiln.runtime.outputs import GenerationOutput
from kiln.runtime.request import Request
from kiln.runtime.sampling import SamplingConfig
from kiln.tokenizer import eos_token_ids, load_tokenizer

Prompt = Union[str, Sequence[int]]


def default_build_config(config: PretrainedConfig) -> BuildConfig:
    """Limits used when LLM builds an engine itself: up to 4096 tokens per sequence, 64 sequences at once."""
    max_seq_len = min(config.max_position_embeddings, 4096)
    return BuildConfig(max_batch_size=64, max_input_len=max_seq_len - 1, max_seq_len=max_seq_len)


def load_engine(model, dtype: str = "auto", build_config: BuildConfig | None = None, quiet: bool = False) -> Engine:
    """An Engine from an Engine, a PretrainedModel, or a path to an engine, checkpoint, HF dir or GGUF file."""
    if isinstance(model, Engine):
        return model
    if isinstance(model, PretrainedModel):
        return build(model, build_config or default_build_config(model.config), quiet)
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_dir() and is_engine_dir(path):
        if build_config is not None or dtype != "auto":
            raise ValueError(f"{path} is a built engine: build_config and dtype cannot change it; rebuild instead")
        return Engine.from_dir(path)
    if path.is_dir() and is_checkpoint_dir(path):
        if dtype != "auto":
            raise ValueError(f"{path} is a Kiln checkpoint in {load_checkpoint_config(path).dtype}; "
                             "dtype is chosen at conversion")
        loaded = model_class(load_checkpoint_config(path).architecture).from_checkpoint(path)
    else:
        loaded = model_class(read_source_config(path, dtype).architecture).from_hugging_face(path, dtype, quiet=quiet)
    return build(loaded, build_config or default_build_config(loaded.config), quiet)


class LLM:
    """Generate text with an engine, building it first when given a model or checkpoint.

        llm = LLM("engine_dir")            # or an HF dir, a .gguf file, a Kiln checkpoint
        for out in llm.generate(["Hello", [1, 2, 3]], SamplingConfig(max_new_tokens=32)):
            print(out.text)
    """

    def __init__(self, model, tokenizer=None, dtype: str = "auto", build_config: BuildConfig | None = None,
                 kv_cache_config: KvCacheConfig | None = None, device: str | torch.device | None = None,
                 quiet: bool = False):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.engine = load_engine(model, dtype, build_config, quiet)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.engine.tokenizer_files)
        self.eos_ids = eos_token_ids(self.tokenizer, self.engine.tokenizer_files)
        self.core = EngineCore(self.engine, self.device, kv_cache_config, quiet)
        self._next_request_id = 0

    @property
    def build_config(self) -> BuildConfig:
        return self.engine.build_config

    @property
    def config(self) -> PretrainedConfig:
        return self.engine.pretrained_config

    def save(self, engine_dir: str | Path) -> None:
        """Write the engine (built here or loaded) to a directory."""
        self.engine.save(engine_dir)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_config: SamplingConfig | Sequence[SamplingConfig] | None = None):
        """Generate for one prompt (→ one GenerationOutput) or a list of prompts (→ a list, in order).

        A prompt is text or a list of token ids; `sampling_config` is one config or one per prompt."""
        single = isinstance(prompts, str) or (isinstance(prompts, Sequence) and len(prompts) > 0
                                              and isinstance(prompts[0], int))
        prompt_list = [prompts] if single else list(prompts)
        configs = self._configs(sampling_config, len(prompt_list))
        requests = [self._make_request(p, c) for p, c in zip(prompt_list, configs)]  # validate all first
        for request in requests:
            self.core.add_request(request)
        while self.core.has_unfinished():
            self.core.step()
        outputs = [self._output(r, p) for r, p in zip(requests, prompt_list)]
        return outputs[0] if single else outputs

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat (a list of {"role", "content"}) with the prompt for the assistant's turn."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this engine's tokenizer has no chat template")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    @staticmethod
    def _configs(sampling_config, n: int) -> list[SamplingConfig]:
        if sampling_config is None or isinstance(sampling_config, SamplingConfig):
            return [sampling_config or SamplingConfig()] * n
        configs = list(sampling_config)
        if len(configs) != n:
            raise ValueError(f"{len(configs)} sampling configs for {n} prompts")
        return configs

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass token ids instead of text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.config.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token id {bad[0]!r} is not in the vocabulary [0, {vocab})")
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        return ids

    def _make_request(self, prompt: Prompt, sampling: SamplingConfig) -> Request:
        ids, build = self._encode(prompt), self.build_config
        if len(ids) > build.max_input_len:
            raise ValueError(f"prompt has {len(ids)} tokens, more than the engine's max_input_len={build.max_input_len}")
        if len(ids) + sampling.max_new_tokens > build.max_seq_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = "
                             f"{len(ids) + sampling.max_new_tokens} exceeds the engine's max_seq_len={build.max_seq_len}")
        if sampling.num_beams > build.max_beam_width:
            raise ValueError(f"SamplingConfig.num_beams={sampling.num_beams} exceeds the engine's "
                             f"max_beam_width={build.max_beam_width}")
        for name in ("end_id", "pad_id"):
            value = getattr(sampling, name)
            if value is not None and value != -1 and not 0 <= value < self.config.vocab_size:
                raise ValueError(f"SamplingConfig.{name}={value} is not in the vocabulary [0, {self.config.vocab_size})")
        end_ids = self.eos_ids if sampling.end_id is None else ([] if sampling.end_id == -1 else [sampling.end_id])
        self._next_request_id += 1
        return Request(self._next_request_id, ids, sampling, frozenset(end_ids))

    def _output(self, request: Request, prompt: Prompt) -> GenerationOutput:
        text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True) if self.tokenizer else ""
        gen_logits = torch.stack(request.generation_logits) if request.generation_logits else None
        tokens, sampling = list(request.output_token_ids), request.sampling
        pad = sampling.pad_id if sampling.pad_id is not None else next(iter(sorted(request.end_ids)), 0)
        padded = tokens + [pad] * (sampling.max_new_tokens - len(tokens))
        return GenerationOutput(request.request_id, prompt if isinstance(prompt, str) else None,
                                list(request.prompt_token_ids), tokens, text, request.finish_reason,
                                padded, request.context_logits, gen_logits)

    def shutdown(self) -> None:
        self.core = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
