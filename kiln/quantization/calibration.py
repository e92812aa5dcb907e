"""Calibration: token sequences of Kiln's calibration text, and the float model run over them (reference kernels)
a layer at a time, each layer's float weights read when it runs and dropped after it, recording per linear layer
each input channel's largest magnitude and per layer the largest cached key and value.
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import random

import torch

from kiln.kernels import AttentionMetadata
from kiln.models.base import PretrainedModel
from kiln.models.llama import MoE
from kiln.utils.steps import progress

from .experts import input_peaks
from .layerwise import adopt_module, float_network

CALIBRATION_SEQ_LEN = 256


def calibration_tokens(model: PretrainedModel, calib_size: int, seq_len: int = CALIBRATION_SEQ_LEN) -> list[list[int]]:
    """`calib_size` token sequences: Kiln's calibration text first, then passages spread over Python's own
    reference documentation (the standard library's pydoc_data: present wherever Python is, nothing to download),
    so that larger sizes bring new tokens rather than repeats (GPTQ overfits a few hundred tokens). Random
    tokens when the model has no tokenizer."""
    from kiln.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model.tokenizer_files)
    if tokenizer is None:
        rng = random.Random(0)
        return [[rng.randrange(model.config.vocab_size) for _ in range(seq_len)] for _ in range(calib_size)]
    own = tokenizer.encode(importlib.resources.files("kiln.data").joinpath("calibration.txt").read_text())
    chunks = [own[i:i + seq_len] for i in range(0, len(own), seq_len)][:calib_size]
    if len(chunks) < calib_size:
        from pydoc_data.topics import topics

        docs = tokenizer.encode("\n\n".join(topics[name] for name in sorted(topics)))
        wanted = calib_size - len(chunks)
        stride = max(seq_len, (len(docs) - seq_len) // wanted)
        chunks += [docs[i * stride:i * stride + seq_len] for i in range(wanted)]
    return chunks


@dataclasses.dataclass
class CalibrationStats:
    inputs: dict[str, torch.Tensor]      # engine module name → (in_features,) largest |input| per channel
    kv: list[tuple[float, float]]        # per layer: largest |key|, largest |value|


@torch.inference_mode()
def calibrate(model: PretrainedModel, sequences: list[list[int]], quiet: bool = False,
              device: torch.device | str | None = None) -> CalibrationStats:
    """Each sequence through the float network on `device` (default: where the weights are), one layer at a time
    for all sequences: the same products, sequence by sequence, as the whole network would compute."""
    net, fused, device = float_network(model, max(len(s) for s in sequences), device)
    inputs: dict[str, torch.Tensor] = {}

    def keep(name, peak):
        inputs[name] = torch.maximum(inputs[name], peak) if name in inputs else peak

    def record(name):
        def hook(_module, args):
            keep(name, args[0].detach().float().abs().amax(dim=0))
        return hook

    def record_experts(name):                   # layers.3.moe → layers.3.moe.gate_up_proj, layers.3.moe.down_proj
        def hook(module, args):
            for projection, peak in input_peaks(module, args[0].detach()).items():
                keep(f"{name}.{projection.removeprefix('moe.')}", peak)
        return hook

    for name, module in net.named_modules():
        if type(module).__name__ == "Linear":
            module.register_forward_pre_hook(record(name))
        elif isinstance(module, MoE):
            module.register_forward_pre_hook(record_experts(name))
    kv = _run_layers(net, fused, sequences, device, quiet)
    return CalibrationStats(inputs, kv)


def _run_layers(net, fused, sequences: list[list[int]], device, quiet: bool) -> list[tuple[float, float]]:
    """Run every sequence through the network a layer at a time (adopting each layer's weights from `fused`, then
    dropping them), the final norm and the logits last; per layer the largest cached |key| and |value|."""
    c = net.config
    t = lambda values: torch.tensor(values, device=device)  # noqa: E731
    runs = [(t(seq), t(list(range(len(seq)))),
             AttentionMetadata(t(list(range(len(seq)))), t([0, len(seq)]), t([len(seq)]),
                               t([list(range(-(-len(seq) // 16)))]), len(seq), len(seq), 16)) for seq in sequences]
    adopt_module(net, fused, "embed_tokens", device)
    states = [(net.embed(ids), None) for ids, _, _ in runs]
    if not c.tie_word_embeddings:
        net.release("embed_tokens")
    blocks = -(-max(len(s) for s in sequences) // 16)
    cache = torch.zeros((2, blocks, 16, c.num_key_value_heads, c.head_dim), dtype=getattr(torch, c.dtype),
                        device=device)
    kv = []
    for name, layer in progress(net.layers.items(), "Calibrating layers", total=len(net.layers), quiet=quiet):
        adopt_module(net, fused, f"layers.{name}", device)
        peaks = (0.0, 0.0)
        for index, (_, positions, meta) in enumerate(runs):
            states[index] = layer(*states[index], positions, meta, cache, net.cos_sin)
            peaks = (max(peaks[0], float(cache[0].abs().max())), max(peaks[1], float(cache[1].abs().max())))
            cache.zero_()
        kv.append(peaks)
        net.release(f"layers.{name}")
    adopt_module(net, fused, "norm", device)
    if not c.tie_word_embeddings:
        adopt_module(net, fused, "lm_head", device)
    for x, residual in states:
        net.compute_logits(net.norm(x, residual)[0])
    return kv
