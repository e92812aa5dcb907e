"""The float network run one decoder layer at a time over all calibration sequences (packed into one batch), so
that AWQ and GPTQ quantize each layer on the inputs the already-quantized layers before it produce. Only the
layers being worked on hold weights: each layer's float weights are read (from the model's weights, lazy or not)
when it is reached and dropped when it is advanced past.

    runner = LayerRunner(model, sequences)
    for index, layer in runner.layers():                          # the layer's float weights read now
        inputs = runner.capture(layer, ["attn.qkv_proj", ...])   # (tokens, in) input of each named linear
        ...                                                       # change the layer's weights
        runner.advance(layer)                                     # its outputs become the next layer's inputs

`forward` runs a layer outside inference mode (differentiable, on some of the sequences, with some weights
replaced): learned rounding (tune.py) trains through it.
"""
from __future__ import annotations

import dataclasses

import torch

from kiln.checkpoint.lazy import weights_device
from kiln.config import QuantConfig
from kiln.kernels import AttentionMetadata, ReferenceOps
from kiln.models.base import PretrainedModel
from kiln.models.llama import fused_view

BLOCK = 16


def _packed_metadata(lengths: list[int], device) -> tuple[torch.Tensor, AttentionMetadata]:
    """(positions, metadata) of sequences of `lengths` packed into one prefill batch, each in its own blocks."""
    per_seq = -(-max(lengths) // BLOCK)
    positions = torch.cat([torch.arange(n) for n in lengths])
    slots = torch.cat([b * per_seq * BLOCK + torch.arange(n) for b, n in enumerate(lengths)])
    starts = torch.tensor([0] + lengths).cumsum(0)
    tables = torch.arange(len(lengths) * per_seq).view(len(lengths), per_seq)
    meta = AttentionMetadata(slots.to(device), starts.to(device), torch.tensor(lengths, device=device),
                             tables.to(device), max(lengths), max(lengths), BLOCK)
    return positions.to(device), meta


def float_network(model: PretrainedModel, max_len: int, device=None):
    """(the model's float network on the reference kernels with no weights yet, its engine-layout weights to adopt
    a module at a time (kiln.models.llama.fused_view), the device: `device`, or where the weights are)."""
    config = dataclasses.replace(model.config, quantization=QuantConfig())
    device = torch.device(device) if device is not None else weights_device(model.weights)
    net = model.network_class.empty(config, max_len, device)
    net.use_ops(ReferenceOps())
    return net, fused_view(config, model.weights), device


def adopt_module(net, fused, module: str, device) -> None:
    """The float weights of the network's `module` (e.g. layers.3) made and taken by the network."""
    net.adopt(dict(fused.iter_take([n for n in fused if n.startswith(module + ".")])), device)


class LayerRunner:
    """Float copy of the model's network (reference kernels) on `device` (default: where the weights are); the
    caller may replace its layers' weights."""

    def __init__(self, model: PretrainedModel, sequences: list[list[int]], device=None):
        if model.config.mapping.world_size > 1:
            raise ValueError("layer-by-layer calibration (AWQ, GPTQ) needs an unsharded model")
        lengths = [len(s) for s in sequences]
        self.lengths, self.starts = lengths, [0, *torch.tensor(lengths).cumsum(0).tolist()]
        self.net, self.fused, device = float_network(model, max(lengths), device)
        self.device, config = device, self.net.config
        self.positions, self.meta = _packed_metadata(lengths, device)
        blocks = int(self.meta.block_tables.numel())
        dtype = getattr(torch, config.dtype)
        self.cache = torch.zeros((2, blocks, BLOCK, config.num_key_value_heads, config.head_dim), dtype=dtype,
                                 device=device)
        ids = torch.tensor([t for s in sequences for t in s], device=device)
        adopt_module(self.net, self.fused, "embed_tokens", device)
        with torch.inference_mode():
            self.hidden, self.residual = self.net.embed(ids), None
        self.net.release("embed_tokens")

    def layers(self):
        """(index, layer) of each layer in order, its float weights read as it is reached."""
        for index, layer in self.net.layers.items():
            adopt_module(self.net, self.fused, f"layers.{index}", self.device)
            yield index, layer

    @torch.inference_mode()
    def _run(self, layer):
        return layer(self.hidden, self.residual, self.positions, self.meta, self.cache, self.net.cos_sin)

    def capture(self, layer, names: list[str]) -> dict[str, torch.Tensor]:
        """The float32 inputs (tokens, in) that the layer's linear modules `names` see on this layer's inputs."""
        inputs, handles = {}, []
        for name in names:
            def hook(_module, args, name=name):
                inputs[name] = args[0].detach().float()
            handles.append(layer.get_submodule(name).register_forward_pre_hook(hook))
        try:
            self._run(layer)
        finally:
            for handle in handles:
                handle.remove()
        return inputs

    def kv_peaks(self) -> tuple[float, float]:
        """Largest |key| and |value| that the layer last run wrote to the cache."""
        return float(self.cache[0].abs().max()), float(self.cache[1].abs().max())

    def advance(self, layer) -> None:
        """Run `layer` as it now is; its outputs become the inputs of the next one, and its weights are dropped."""
        self.hidden, self.residual = self._run(layer)
        layer.to("meta")

    def stream(self) -> torch.Tensor:
        """The residual stream entering the next layer (hidden + residual: what its first RMSNorm normalises), as
        an ordinary tensor that autograd may use."""
        with torch.inference_mode(False):
            return (self.hidden if self.residual is None else self.hidden + self.residual).clone()

    def rows(self, x: torch.Tensor, sequences) -> torch.Tensor:
        """The rows of packed tensor x (one per token) that belong to `sequences` (indices), in their order."""
        return torch.cat([x[self.starts[i]:self.starts[i + 1]] for i in sequences])

    def forward(self, layer, stream: torch.Tensor, sequences=None, weights: dict | None = None) -> torch.Tensor:
        """The residual stream after `layer` for the tokens of `sequences` (default: all) of `stream`, with the
        layer's parameters named in `weights` replaced by those tensors (differentiably)."""
        sequences = range(len(self.lengths)) if sequences is None else sequences
        positions, meta = _packed_metadata([self.lengths[i] for i in sequences], stream.device)
        cache = torch.zeros((2, int(meta.block_tables.numel()), *self.cache.shape[2:]), dtype=self.cache.dtype,
                            device=self.cache.device)
        args = (self.rows(stream, sequences), None, positions, meta, cache, self.net.cos_sin)
        hidden, residual = torch.func.functional_call(layer, weights or {}, args)
        return hidden + residual
