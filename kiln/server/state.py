"""What every route of one server shares: the LLM, its settings, the queue, the metrics, and the worker thread
that does the LLM's CPU work for requests (chat templates, tokenising, submitting) off the event loop."""
from __future__ import annotations

import asyncio
import copy
import functools
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request

from .admission import Admission
from .config import ServerConfig
from .errors import invalid
from .logprobs import TokenStrings
from .metrics import ServerMetrics
from .models import Model, ServedModels


def longest_token_chars(tokenizer) -> int | None:
    """Characters of the vocabulary's longest token string, as the tokenizer stores it (a byte-level BPE stores
    one character per byte): no token stands for more characters of text than that."""
    vocab = getattr(tokenizer, "get_vocab", None)
    return max(map(len, vocab()), default=1) if vocab is not None else None


class ServerState:
    def __init__(self, llm, config: ServerConfig):
        self.llm, self.config = llm, config
        self.models = ServedModels(llm, config.model_name, config.lora_modules, int(time.time()))
        self.admission = Admission(llm.build_config.max_batch_size + config.max_queue)
        self.metrics = ServerMetrics(llm.stats, lambda: self.admission.active)
        self.strings = TokenStrings(copy.deepcopy(llm.tokenizer))       # its own copy: used on the event loop
        self.max_token_chars = longest_token_chars(llm.tokenizer)
        self.fingerprint = f"fp_{llm.engine.hash[:12]}"
        # One thread, so the LLM is called from one thread at a time, as when requests were submitted on the loop.
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="kiln-server")

    async def offload(self, fn, *args):
        """fn(*args) on the worker thread. A cancelled caller does not stop fn: it runs to its end, or not at all."""
        return await asyncio.get_running_loop().run_in_executor(self.worker, functools.partial(fn, *args))

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)

    def resolve_model(self, request: Request, name: str) -> Model:
        """The model a request names (else 404 model_not_found); an adapter's name goes in the request's log line."""
        model = self.models.resolve(name)
        if model.lora is not None:
            request.state.adapter = name
        return model

    def check_prompt_size(self, prompt: str | list[int], param: str) -> None:
        """Refuse at once, before any tokenising, a prompt that cannot fit max_input_len: token ids by their
        count; text by its length, as C characters are at least C / max_token_chars tokens."""
        limit = self.llm.build_config.max_input_len
        if isinstance(prompt, list) and len(prompt) > limit:
            raise invalid(f"prompt has {len(prompt)} tokens, more than the engine's max_input_len={limit}", param,
                          "context_length_exceeded")
        longest = self.max_token_chars
        if isinstance(prompt, str) and longest is not None and len(prompt) > limit * longest:
            raise invalid(f"prompt has {len(prompt)} characters, so at least {-(-len(prompt) // longest)} tokens "
                          f"(no token is longer than {longest} characters), more than the engine's "
                          f"max_input_len={limit}", param, "context_length_exceeded")

    def note_prompt(self, request: Request, prompt, user: str | None) -> None:
        """Remember what the log line may show: the user id, and the prompt only with log_prompts."""
        request.state.user = user
        if self.config.log_prompts:
            request.state.prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt

    def prompt_text(self, prompt: str | list[int]) -> str:
        """A prompt as text (token ids are decoded), for echo; on the worker thread."""
        if isinstance(prompt, str):
            return prompt
        if self.llm.tokenizer is None:
            raise invalid("echo of a token-id prompt needs a tokenizer; this engine has none", "echo")
        return self.llm.tokenizer.decode(prompt, skip_special_tokens=False, clean_up_tokenization_spaces=False)
