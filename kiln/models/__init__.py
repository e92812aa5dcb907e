"""Model definitions and the registry from Hugging Face architecture names to Kiln model classes."""
from __future__ import annotations

from kiln.config.pretrained import SUPPORTED_ARCHITECTURES, check_architecture

from .base import PretrainedModel
from .llama import DecoderForCausalLM, LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM

MODEL_CLASSES: dict[str, type[PretrainedModel]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}
assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)
LLaMAForCausalLM = LlamaForCausalLM       # the seed's (TensorRT-LLM's) spelling


def model_class(architecture: str) -> type[PretrainedModel]:
    check_architecture(architecture)
    return MODEL_CLASSES[architecture]


__all__ = ["DecoderForCausalLM", "LLaMAForCausalLM", "LlamaForCausalLM", "MODEL_CLASSES", "MistralForCausalLM", "MixtralForCausalLM",
           "PretrainedModel", "Qwen2ForCausalLM", "model_class"]
