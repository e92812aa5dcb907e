"""The models one server serves, each by name: the base model and LoRA adapters. A request's `model`
picks one: the base model's name → no adapter, an adapter's name → that adapter, anything else → 404
model_not_found naming the served models.

Adapters come from ServerConfig.lora_modules and from the engine (LoraConfig.lora_dir stores them in it), each read
and checked against the engine before it is served; authenticated clients load and unload more at run time.
Unloading takes effect for the requests that come next; those already admitted finish under the adapter. The LLM
keeps one directory per adapter name for its life, so every load gets a name of its own in the LLM (the served
name, else name@2, name@3, ...): an adapter loaded again, perhaps retrained at the same path, is read afresh.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kiln.runtime.request import LoRARequest

from .config import adapter_name_problem
from .errors import APIError, invalid

MAX_NAMED = 16   # models named in a model_not_found message


@dataclass(frozen=True)
class Model:
    """A model a request named: the base model (lora None) or a LoRA adapter."""

    name: str
    lora: LoRARequest | None = None


def check_adapter(llm, lora: LoRARequest) -> None:
    """Read the adapter and check it against the engine, as LLM.generate does before it queues a request (the LLM
    keeps it in its host cache). Raises ValueError naming the adapter, its directory and what is wrong."""
    try:
        llm.core.runner.lora.register(lora)
    except ValueError:                           # (a missing file's AdapterNotFound is an OSError too)
        raise
    except OSError as err:                       # e.g. a file it may not read
        raise ValueError(f"LoRA adapter {lora.name!r} ({lora.path}): {err}") from None


class ServedModels:
    def __init__(self, llm, base: str, lora_modules: dict[str, str], created: int):
        self.llm, self.base, self.created = llm, base, created
        self.adapters: dict[str, LoRARequest] = {}      # served name → its adapter, in the order loaded
        self._llm_names: set[str] = set()               # every adapter name given to the LLM
        self._loading: set[str] = set()
        stored = dict(llm.engine.adapters)
        clash = sorted(lora_modules.keys() & stored.keys())
        if clash:
            raise ValueError(f"lora_modules: {clash[0]!r} is also the name of an adapter stored in the engine "
                             f"({stored[clash[0]]}); serve the other directory under another name")
        for name, path in {**stored, **lora_modules}.items():
            problem = adapter_name_problem(name, base)
            if problem:
                raise ValueError(f"the engine's LoRA adapters: {problem}" if name in stored else problem)
            lora = self._new_lora(name, path)
            check_adapter(llm, lora)
            self.adapters[name] = lora

    def _new_lora(self, name: str, path: str) -> LoRARequest:
        """The adapter at `path` under a name the LLM has not seen (the served name when it is new)."""
        llm_name, n = name, 1
        while llm_name in self._llm_names:
            n += 1
            llm_name = f"{name}@{n}"
        self._llm_names.add(llm_name)
        return LoRARequest(llm_name, str(path))

    def names(self) -> list[str]:
        return [self.base, *self.adapters]

    def resolve(self, name: str) -> Model:
        """The model a request named; 404 model_not_found (OpenAI's error) naming the served ones otherwise."""
        if name == self.base:
            return Model(name)
        lora = self.adapters.get(name)
        if lora is None:
            names = self.names()
            listed = ", ".join(map(repr, names[:MAX_NAMED])) + (f" and {len(names) - MAX_NAMED} more"
                                                                if len(names) > MAX_NAMED else "")
            raise APIError(404, f"the model {name!r} does not exist; this server serves {listed}", "model_not_found",
                           "model")
        return Model(name, lora)

    def card(self, name: str) -> dict:
        """/v1/models' entry of a served model (an adapter's parent is the base model, as vLLM lists them)."""
        self.resolve(name)
        return {"id": name, "object": "model", "created": self.created, "owned_by": "kiln",
                "max_model_len": self.llm.build_config.max_seq_len, "parent": None if name == self.base else self.base}

    async def load(self, name: str, path: str) -> dict:
        """Serve the adapter at `path` as `name` once it has been read and checked (off the event loop)."""
        problem = adapter_name_problem(name, self.base)
        if name == self.base or name in self.adapters or name in self._loading:
            raise invalid(f"a model named {name!r} is served already; unload it first", "lora_name", "model_exists")
        if problem:
            raise invalid(problem, "lora_name")
        lora = self._new_lora(name, path)
        self._loading.add(name)
        try:
            await asyncio.to_thread(check_adapter, self.llm, lora)
        except ValueError as err:
            raise invalid(str(err), "lora_path", "invalid_adapter") from None
        except RuntimeError as err:
            raise APIError(503, f"the engine cannot take adapters: {err}", "engine_unavailable") from None
        finally:
            self._loading.discard(name)
        self.adapters[name] = lora
        return self.card(name)

    def unload(self, name: str) -> dict:
        """Stop serving the adapter `name`: later requests naming it get 404; admitted ones finish under it."""
        if name == self.base:
            raise invalid(f"{name!r} is the base model, not an adapter; it cannot be unloaded", "lora_name")
        if self.adapters.pop(name, None) is None:
            raise APIError(404, f"no LoRA adapter named {name!r} is served", "model_not_found", "lora_name")
        return {"id": name, "object": "model", "deleted": True}
