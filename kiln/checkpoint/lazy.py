"""Weights known by name, shape and dtype before any is made, each made when it is used (read from a file,
converted, quantized, sharded, fused) and not kept: what lets conversion and building hold about one layer.

    weights = LazyWeights(specs, units, make, "source")   # make(unit's names) → {name: tensor} of that unit
    for name, tensor in weights.items():                  # unit by unit, in order, each made once
        ...
    weights["layers.0.attn.q_proj.weight"]                # makes its unit (and drops the rest of it)

A unit is what is made together: one tensor of a file, an expert stack, a quantized layer, a fused layer. Units
are ordered layer by layer (the embedding first, the final norm and LM head last). A transform takes its inputs
from a dict of tensors or another LazyWeights through `iter_take`, which makes each unit it needs once.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


class LazyWeights(Mapping):
    """name → tensor, made a unit at a time by `make` (on `device`); every made tensor is checked against its
    spec."""

    def __init__(self, specs: dict[str, TensorSpec], units: list[list[str]],
                 make: Callable[[list[str]], dict[str, torch.Tensor]], source: str,
                 device: str | torch.device = "cpu"):
        self.specs, self.source, self.device = specs, source, torch.device(device)
        self._units, self._make = units, make
        self._unit_of = {name: index for index, unit in enumerate(units) for name in unit}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.specs:
            raise KeyError(name)
        return self._made(self._units[self._unit_of[name]])[name]

    def __iter__(self):
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def __contains__(self, name) -> bool:
        return name in self.specs

    def unit_names(self) -> list[list[str]]:
        return self._units

    def units(self) -> Iterator[dict[str, torch.Tensor]]:
        for unit in self._units:
            yield self._made(unit)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for made in self.units():
            yield from made.items()

    def values(self) -> Iterator[torch.Tensor]:
        return (tensor for _, tensor in self.items())

    def iter_take(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of each of `names` (in unit order), each unit they need made once."""
        wanted = set(names)
        for index in sorted({self._unit_of[name] for name in wanted}):
            made = self._made(self._units[index])
            for name in self._units[index]:
                if name in wanted:
                    yield name, made.pop(name)

    def _made(self, unit: list[str]) -> dict[str, torch.Tensor]:
        made = self._make(unit)
        for name in unit:
            spec, tensor = self.specs[name], made[name]
            if tuple(tensor.shape) != spec.shape:
                raise ValueError(f"{self.source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{spec.shape}")
            if tensor.dtype != spec.dtype:
                raise ValueError(f"{self.source}: tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}, "
                                 f"expected {str(spec.dtype).removeprefix('torch.')}")
        return made


def weight_specs(weights: Mapping) -> dict[str, TensorSpec]:
    """name → TensorSpec of a dict of tensors or LazyWeights (nothing is made)."""
    if isinstance(weights, LazyWeights):
        return weights.specs
    return {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in weights.items()}


def weights_device(weights: Mapping) -> torch.device:
    """The device a dict's tensors are on, or LazyWeights are made on."""
    if isinstance(weights, LazyWeights):
        return weights.device
    first = next(iter(weights.values()), None)
    return torch.device("cpu") if first is None else first.device


def iter_take(weights: Mapping, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of `names` from a dict of tensors or LazyWeights (made a unit at a time)."""
    if isinstance(weights, LazyWeights):
        return weights.iter_take(names)
    return ((name, weights[name]) for name in names)


def materialize(weights: Mapping, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
    """Every tensor made (moved to `device` as it is made, when given): a dict."""
    return {name: t if device is None else t.to(device) for name, t in weights.items()}


def meta_tensors(weights: Mapping) -> dict[str, torch.Tensor]:
    """Tensors of the same shapes and dtypes on the meta device (no memory, nothing made)."""
    return {name: torch.empty(spec.shape, dtype=spec.dtype, device="meta")
            for name, spec in weight_specs(weights).items()}


def layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    return int(m[1]) if m else None


def unit_key(name: str) -> tuple:
    """Where a tensor's unit comes in layer order: the embedding first, then each layer, then the rest."""
    layer = layer_of(name)
    if layer is not None:
        return 1, layer
    return (0, 0) if name.startswith("embed_tokens.") else (2, 0)


def layer_units(names: Iterable[str]) -> list[list[str]]:
    """`names` grouped by layer (the non-layer tensors by module: embedding, norm, LM head), in layer order."""
    groups: dict[tuple, list[str]] = {}
    for name in names:
        layer = layer_of(name)
        key = unit_key(name) + (("",) if layer is not None else (name.split(".")[0],))
        groups.setdefault(key, []).append(name)
    return [groups[key] for key in sorted(groups)]


def units_like(source: Mapping, names: Iterable[str]) -> list[list[str]]:
    """`names` (tensors of `source`, or made one for one from them) grouped as `source` makes them: its units in
    its order, or a dict's tensors one by one in layer order."""
    wanted = set(names)
    if isinstance(source, LazyWeights):
        return [unit for unit in ([n for n in names_ if n in wanted] for names_ in source.unit_names()) if unit]
    return [[name] for name in sorted(wanted, key=lambda n: (unit_key(n), n))]


def with_progress(weights: Mapping, desc: str, quiet: bool = False) -> Mapping:
    """LazyWeights made as `weights` makes them, each unit made advancing a progress bar on stderr (a dict as it
    is)."""
    from kiln.utils.steps import progress

    if not isinstance(weights, LazyWeights):
        return weights
    total = len(weights.unit_names())
    bar = progress(None, desc, total=total, quiet=quiet)

    def make(names: list[str]) -> dict[str, torch.Tensor]:
        made = dict(weights.iter_take(names))
        bar.update(1)
        if bar.n >= total:
            bar.close()
        return made

    return LazyWeights(weights.specs, weights.unit_names(), make, weights.source, weights.device)
