"""Kiln: turn pretrained LLMs into fast inference engines (PyTorch + Triton) and run them.

Load → convert → build → run:
    model = LlamaForCausalLM.from_hugging_face(dir); model.save_checkpoint(ckpt)
    engine = build(model, BuildConfig(...)); engine.save(engine_dir)
    LLM(engine_dir).generate(prompts, SamplingConfig(...))
"""
from .builder import Engine, build
from .config import (BuildConfig, ConvertConfig, KvCacheConfig, Mapping, PluginConfig, PretrainedConfig,
                     QuantConfig)
from .llm import LLM
from .runtime.outputs import GenerationOutput
from .runtime.sampling import SamplingConfig
from .version import __version__

__all__ = ["BuildConfig", "ConvertConfig", "Engine", "GenerationOutput", "KvCacheConfig", "LLM", "Mapping",
           "PluginConfig", "PretrainedConfig", "QuantConfig", "SamplingConfig", "__version__", "build"]
