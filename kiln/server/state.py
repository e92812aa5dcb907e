"""What every route of one server shares: the LLM, its settings, the queue, the metrics."""
from __future__ import annotations

from fastapi import Request

from .admission import Admission
from .config import ServerConfig
from .errors import APIError, invalid
from .logprobs import TokenStrings
from .metrics import ServerMetrics


class ServerState:
    def __init__(self, llm, config: ServerConfig):
        self.llm, self.config = llm, config
        self.admission = Admission(llm.build_config.max_batch_size + config.max_queue)
        self.metrics = ServerMetrics(llm.stats, lambda: self.admission.active)
        self.strings = TokenStrings(llm.tokenizer)

    def model_card(self, created: int) -> dict:
        return {"id": self.config.model_name, "object": "model", "created": created, "owned_by": "kiln",
                "max_model_len": self.llm.build_config.max_seq_len}

    def check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.config.model_name}'",
                           "model_not_found", "model")

    def note_prompt(self, request: Request, prompt, user: str | None) -> None:
        """Remember what the log line may show: the user id, and the prompt only with log_prompts."""
        request.state.user = user
        if self.config.log_prompts:
            request.state.prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt

    def prompt_text(self, prompt: str | list[int]) -> str:
        """A prompt as text (token ids are decoded), for echo."""
        if isinstance(prompt, str):
            return prompt
        if self.llm.tokenizer is None:
            raise invalid("echo of a token-id prompt needs a tokenizer; this engine has none", "echo")
        return self.llm.tokenizer.decode(prompt, skip_special_tokens=False, clean_up_tokenization_spaces=False)
