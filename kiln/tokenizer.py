"""Tokenizer files travel with checkpoints and engines; transformers turns them into a tokenizer."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def read_tokenizer_files(directory: str | Path) -> dict[str, bytes]:
    """The tokenizer-related files of a model directory, by name."""
    directory = Path(directory)
    return {name: (directory / name).read_bytes() for name in TOKENIZER_FILES if (directory / name).is_file()}


def write_tokenizer_files(files: dict[str, bytes], directory: str | Path) -> None:
    for name, data in files.items():
        (Path(directory) / name).write_bytes(data)


def tokenizer_files_from_gguf(gguf_path: str | Path, has_tokenizer: bool = True) -> dict[str, bytes]:
    """Rebuild a Hugging Face tokenizer from a GGUF file's metadata and return its files ({} if it has none)."""
    from transformers import AutoTokenizer

    if not has_tokenizer:
        return {}
    gguf_path = Path(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return read_tokenizer_files(tmp)


def load_tokenizer(files: dict[str, bytes]):
    """A transformers tokenizer from in-memory tokenizer files; None when there are none. Missing, truncated or
    corrupt files are a ValueError naming the file."""
    if not any(name.startswith("tokenizer") for name in files):
        return None
    for name in files:
        if name.endswith(".json"):
            _json_file(files, name)
    if not any(name in files for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ValueError(f"tokenizer.json is missing: {', '.join(sorted(files))} alone do not make a tokenizer")
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        write_tokenizer_files(files, tmp)
        try:
            return AutoTokenizer.from_pretrained(tmp)
        except Exception as err:  # transformers and tokenizers raise many types for damaged files
            raise ValueError(f"cannot make a tokenizer of {', '.join(sorted(files))}: {err}") from None


def eos_token_ids(tokenizer, files: dict[str, bytes]) -> list[int]:
    """End-of-sequence ids: generation_config.json's list when present, else the tokenizer's eos."""
    ids = []
    if "generation_config.json" in files:
        eos = _json_file(files, "generation_config.json").get("eos_token_id")
        ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"generation_config.json: eos_token_id {eos!r} is not a token id or a list of them")
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return ids


SAMPLING_DEFAULTS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def generation_defaults(files: dict[str, bytes]) -> dict:
    """The sampling settings a model's generation_config.json recommends, as SamplingConfig fields: repetition
    penalty always, and with do_sample true its temperature, top_k, top_p and min_p (transformers' rule: without
    do_sample it decodes greedily). {} without the file."""
    if "generation_config.json" not in files:
        return {}
    config = _json_file(files, "generation_config.json")
    keys = SAMPLING_DEFAULTS if config.get("do_sample") is True else ("repetition_penalty",)
    defaults = {key: config[key] for key in keys if config.get(key) is not None}
    if defaults.get("repetition_penalty") == 1.0:
        del defaults["repetition_penalty"]
    if defaults.get("top_k") == 0:
        del defaults["top_k"]
    return defaults


def _json_file(files: dict[str, bytes], name: str) -> dict:
    try:
        data = json.loads(files[name])
    except ValueError as err:
        raise ValueError(f"{name} is corrupt or truncated ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{name} is corrupt: not a JSON object")
    return data
