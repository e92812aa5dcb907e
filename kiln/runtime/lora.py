"""The LoRA adapters of a running engine (one rank's share of each).

    LoRARequest ──register (caller's thread: read, checked)──▶ host cache (max_cpu_loras, LRU)
                                                                   │ assign (engine thread, per step)
                                                                   ▼
    device slots 0..max_loras-1 (LRU; never evicting one a running request uses) ── each linear layer's .lora[slot]
    Step.lora_slots (adapter slot per sequence) ──batch──▶ LoraBatch: the packed tokens of each slot

Rank 0 decides the slots and sends what it installed this step in the Step (`lora_loads`); other ranks install the
same adapters (read from the same directories, cut for their rank) into the same slots.
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from kiln.checkpoint.lora import LoraAdapter, load_adapter
from kiln.config import LoraCacheConfig, LoraConfig, PretrainedConfig
from kiln.kernels import LoraBatch

from .request import LoRARequest, Request
from .step import Step


class LoraManager:
    """Host cache, device slots and per-step token groups of the LoRA adapters of one rank's network."""

    def __init__(self, net, config: PretrainedConfig, lora_config: LoraConfig, cache: LoraCacheConfig,
                 device: torch.device):
        self.net, self.config, self.device = net, config, device
        self.max_rank, self.targets = lora_config.max_lora_rank, lora_config.target_modules
        self.max_loras, self.host_capacity = cache.max_loras, cache.host_capacity
        self.known: dict[str, LoRARequest] = {}                       # name → the adapter it stands for
        self.ids: dict[int, str] = {}                                 # LoRARequest.id → name
        self.host: OrderedDict[str, LoraAdapter] = OrderedDict()      # least recently used first
        self.slots: OrderedDict[str, int] = OrderedDict()             # name → device slot, least recently used first
        self.installed: dict[int, list] = {}                          # slot → the layers holding its parts
        self.lock = threading.Lock()                                  # register runs on callers' threads
        self.reads = 0                                                # adapters read from disk (for tests, stats)

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

    def _read(self, request: LoRARequest) -> LoraAdapter:
        """The adapter from the host cache, or read from its directory (and the least recently used dropped)."""
        adapter = self.host.get(request.name)
        if adapter is None:
            adapter = load_adapter(request.path, self.config, self.max_rank, self.targets, request.name)
            self.net.lora_layers(adapter.modules)              # the network can take it (refused before it runs)
            self.reads += 1
            self.host[request.name] = adapter
            while len(self.host) > self.host_capacity:
                self.host.popitem(last=False)
        self.host.move_to_end(request.name)
        return adapter

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
        """Put the adapter's parts on the device in `slot` of each layer it targets (replacing the slot's adapter)."""
        with self.lock:
            adapter = self._read(lora).to(self.device)
        for layer in self.installed.pop(slot, []):
            layer.lora.pop(slot, None)
        for name in [n for n, s in self.slots.items() if s == slot]:
            del self.slots[name]
        layers = self.net.lora_layers(adapter.modules)
        for name, parts in adapter.modules.items():
            layers[name].lora[slot] = parts
        self.installed[slot] = list(layers.values())
        self.slots[lora.name] = slot

    def close(self) -> None:
        """Drop the network and every adapter (ModelRunner.close frees the device memory)."""
        with self.lock:
            self.net = None
            self.host.clear()
            self.slots.clear()
            self.installed.clear()

    # --- a step's tokens --------------------------------------------------------------------------------------
    def batch(self, step: Step) -> LoraBatch | None:
        """The packed tokens of each adapter slot in the step (contiguous runs as slices), or None: no adapter."""
        if step.lora_slots is None:
            return None
        runs: dict[int, list[tuple[int, int]]] = {}
        starts = step.query_start_loc
        for i, slot in enumerate(step.lora_slots):
            if slot < 0:
                continue
            spans = runs.setdefault(slot, [])
            if spans and spans[-1][1] == starts[i]:
                spans[-1] = (spans[-1][0], starts[i + 1])
            else:
                spans.append((starts[i], starts[i + 1]))
        groups = []
        for slot, spans in runs.items():
            if len(spans) == 1:
                groups.append((slot, slice(*spans[0])))
            else:
                rows = [row for begin, end in spans for row in range(begin, end)]
                groups.append((slot, torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)))
        return LoraBatch(groups) if groups else None
