"""The LoRA adapters of a running engine (one rank's share of each).

    LoRARequest ──register (caller's thread: read, checked, laid out per layer)──▶ host cache (max_cpu_loras, LRU)
                                                                   │ assign (engine thread, per step)
                                                                   ▼
    device slots 0..max_loras-1 (LRU; never evicting one a running request uses) ── each layer's LoraStack
    Step.lora_slots (adapter slot per sequence) ──batch──▶ LoraBatch: the packed tokens of each slot

Each linear layer an adapter may target holds a LoraStack (kiln/kernels/lora.py): the A, B and scales of every
slot, at fixed addresses, a view of one LoraSlab. An engine that reserves the slab (`reserve`: it was built with
lora_plugin or stored adapters) allocates it at load, before its KV cache and CUDA graphs, which then run adapters
too; any other engine allocates it when its first adapter is installed, and runs adapter steps without graphs.

Rank 0 decides the slots and sends what it installed this step in the Step (`lora_loads`); other ranks install the
same adapters (read from the same directories, cut for their rank) into the same slots.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from kiln.checkpoint.lora import ENGINE_MODULE, layer_geometry, load_adapter
from kiln.config import LoraCacheConfig, LoraConfig, PretrainedConfig
from kiln.kernels import LoraBatch, LoraImage, LoraSlab, LoraStack

from .request import LoRARequest, Request
from .step import Step


class LoraManager:
    """Host cache, device slots and per-step token groups of the LoRA adapters of one rank's network."""

    def __init__(self, net, config: PretrainedConfig, lora_config: LoraConfig, cache: LoraCacheConfig,
                 device: torch.device, reserve: bool = False):
        self.net, self.config, self.device = net, config, device
        self.max_rank, self.targets = lora_config.max_lora_rank, lora_config.target_modules
        self.max_loras, self.host_capacity = cache.max_loras, cache.host_capacity
        self.known: dict[str, LoRARequest] = {}                       # name → the adapter it stands for
        self.ids: dict[int, str] = {}                                 # LoRARequest.id → name
        self.host: OrderedDict[str, LoraImage] = OrderedDict()        # name → flat host image, LRU first
        self.layout: LoraSlab | None = None                           # the slab's layout, on the meta device
        self.slab: LoraSlab | None = None                             # every layer's slots (allocated once)
        self.slots: OrderedDict[str, int] = OrderedDict()             # name → device slot, least recently used first
        self.lock = threading.Lock()                                  # register runs on callers' threads
        self.reads = 0                                                # adapters read from disk (for tests, stats)
        if reserve:
            self._allocate()

    # --- host side -------------------------------------------------------------------------------------------
    def register(self, request: LoRARequest) -> None:
        """Check a request's adapter before it is queued: one path (and id) per name, and the adapter read and
        checked against the engine (kept in the host cache). Raises ValueError (FileNotFoundError for missing
        files) naming what is wrong."""
        with self.lock:
            if self.net is None:
                raise RuntimeError("the LLM has been shut down")
            known = self.known.get(request.name)
            if known is not None and known.path != request.path:
                raise ValueError(f"LoRA adapter name {request.name!r} already stands for {known.path}; give the "
                                 f"adapter at {request.path} another name")
            if known is not None and request.id is not None and known.id not in (None, request.id):
                raise ValueError(f"LoRA adapter {request.name!r} has id {known.id}, not {request.id}")
            if request.id is not None and self.ids.get(request.id, request.name) != request.name:
                raise ValueError(f"LoRA adapter id {request.id} already stands for {self.ids[request.id]!r}")
            self._read(request)
            if known is None or known.id is None:
                self.known[request.name] = request
            if request.id is not None:
                self.ids[request.id] = request.name

    def _read(self, request: LoRARequest) -> LoraImage:
        """The adapter's flat image (LoraSlab.image) from the host cache, or read from its directory and laid out
        (and the least recently used adapter dropped); pinned where it goes to a GPU."""
        image = self.host.get(request.name)
        if image is None:
            adapter = load_adapter(request.path, self.config, self.max_rank, self.targets, request.name)
            image = self._slab_layout().image(adapter.modules)
            image = image.pin() if self.device.type == "cuda" else image
            self.reads += 1
            self.host[request.name] = image
            while len(self.host) > self.host_capacity:
                self.host.popitem(last=False)
        self.host.move_to_end(request.name)
        return image

    @property
    def stacks(self) -> dict[str, LoraStack]:
        """Layer name → its adapter slots (empty until allocated)."""
        return self.slab.stacks if self.slab is not None else {}

    def _geometries(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Every layer an adapter may target (refused by the network where its kernels fuse them) → (in_features,
        projection bounds)."""
        names = [f"layers.{i}.{module}" for i in self.net.layers.keys() for module in self._modules()]
        return {name: layer_geometry(name, self.config) for name in self.net.lora_layers(names)}

    def _slab_layout(self) -> LoraSlab:
        if self.layout is None:
            self.layout = LoraSlab(self._geometries(), 1, self.max_rank, getattr(torch, self.config.dtype), "meta")
        return self.layout

    def _allocate(self) -> None:
        """The slab of max_loras slots of every layer an adapter may target; each layer gets its stack."""
        if self.slab is not None:
            return
        layout = self._slab_layout()
        try:
            self.slab = LoraSlab(layout.geometries, self.max_loras, self.max_rank, layout.dtype, self.device)
        except torch.OutOfMemoryError:
            raise RuntimeError(f"no device memory left for {self.max_loras} LoRA adapter slots of rank "
                               f"{self.max_rank}; build the engine with lora_plugin (or stored adapters) so the "
                               "slots are reserved at load, or lower max_loras / max_lora_rank") from None
        for name, layer in self.net.lora_layers(list(self.stacks)).items():
            layer.lora = self.stacks[name]

    def _modules(self) -> list[str]:
        """The engine modules (attn.qkv_proj, ...) the engine's target projections live in."""
        wanted = [ENGINE_MODULE[t] for t in self.targets
                  if not (self.config.is_moe and ENGINE_MODULE[t].startswith("mlp"))]
        return list(dict.fromkeys(wanted))

    # --- device slots (engine thread) ------------------------------------------------------------------------
    def assign(self, scheduled: list[Request], running: list[Request]) -> tuple[dict[str, int], list, list]:
        """Slots for the adapters of a step's requests (`scheduled`), installing those not on the device into free
        slots or in place of the least recently used adapter that no `running` request uses. Returns (slot by
        adapter name, [(slot, LoRARequest)] installed now, [(request, error)] for requests whose adapter could not
        be read again from its directory)."""
        wanted = {r.lora_request.name: r.lora_request for r in scheduled if r.lora_request is not None}
        for name in wanted.keys() & self.slots.keys():
            self.slots.move_to_end(name)
        loads, failed = [], []
        for name, lora in wanted.items():
            if name in self.slots:
                continue
            try:
                self.install(self._free_slot(wanted, running), lora)
            except (OSError, ValueError) as err:
                failed += [(r, err) for r in scheduled if r.lora_request is not None and r.lora_request.name == name]
                continue
            loads.append((self.slots[name], lora))
        return dict(self.slots), loads, failed

    def _free_slot(self, wanted: dict, running: list[Request]) -> int:
        taken = set(self.slots.values())
        free = [slot for slot in range(self.max_loras) if slot not in taken]
        if free:
            return free[0]
        busy = set(wanted) | {r.lora_request.name for r in running if r.lora_request is not None}
        victim = next((name for name in self.slots if name not in busy), None) or \
            next((name for name in self.slots if name not in wanted), None)
        if victim is None:
            raise RuntimeError(f"a step uses more than max_loras={self.max_loras} adapters (scheduler invariant "
                               "broken)")
        return self.slots.pop(victim)

    def install(self, slot: int, lora: LoRARequest) -> None:
        """Copy the adapter's image into `slot` of every layer (replacing the slot's adapter)."""
        self._allocate()
        with self.lock:
            image = self._read(lora)
        for name in [n for n, s in self.slots.items() if s == slot]:
            del self.slots[name]
        self.slab.load(slot, image)
        self.slots[lora.name] = slot

    def close(self) -> None:
        """Drop the network and every adapter (ModelRunner.close frees the device memory)."""
        with self.lock:
            if self.net is not None and self.stacks:
                for layer in self.net.lora_layers(list(self.stacks)).values():
                    layer.lora = None
            self.net = None
            self.host.clear()
            self.slots.clear()
            self.slab = None

    # --- a step's tokens --------------------------------------------------------------------------------------
    def batch(self, step: Step) -> LoraBatch | None:
        """The packed tokens of each adapter slot in the step, or None: no adapter."""
        if step.lora_slots is None:
            return None
        starts = step.query_start_loc
        token_slots = [slot for i, slot in enumerate(step.lora_slots) for _ in range(starts[i], starts[i + 1])]
        return LoraBatch.of(token_slots, self.max_loras, self.device)
