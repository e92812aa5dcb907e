"""Hugging Face model ids (`org/name`) in place of a local directory: resolved through huggingface_hub's cache —
downloaded once, then read from the cache; `revision` picks a branch, tag or commit; the token comes from the
environment (HF_TOKEN) or `huggingface-cli login`; HF_HUB_OFFLINE=1 reads the cache only."""
from __future__ import annotations

import re
from pathlib import Path

MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]   # configs, weights, tokenizer; no .bin
                                                                          # where safetensors exist (see resolve)


def is_model_id(model) -> bool:
    """Whether `model` names a hub model rather than a local path (no such path exists, and it reads org/name)."""
    return isinstance(model, str) and bool(MODEL_ID.match(model)) and not Path(model).exists()


def resolve(model, revision: str | None = None):
    """A local path (or object) as it is; a model id → the directory of its snapshot in the hub cache. Raises
    FileNotFoundError naming the id when it cannot be had (offline and not cached, unknown, gated, no revision)."""
    if not is_model_id(model):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hugging Face model ids; {model!r} is a local path")
        return model
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    try:
        path = Path(snapshot_download(model, revision=revision, allow_patterns=MODEL_FILES))
        if not any(path.glob("*.safetensors")):         # an older model: its weights are .bin files only
            path = Path(snapshot_download(model, revision=revision, allow_patterns=MODEL_FILES + ["*.bin"]))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(f"{model!r} is neither a local path nor in the Hugging Face hub cache, and the hub "
                                "cannot be reached (HF_HUB_OFFLINE is set, or no network): download it where "
                                "there is one, or give a local directory") from None
    except GatedRepoError:
        raise FileNotFoundError(f"{model!r} is gated on the Hugging Face hub: accept its license there and set "
                                "HF_TOKEN") from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"{model!r} has no revision {revision!r} on the Hugging Face hub") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{model!r} is neither a local path nor a model on the Hugging Face hub (or it is "
                                "private: set HF_TOKEN)") from None
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{model!r} (revision {revision or 'main'}) has no config.json: not a transformers "
                                "model Kiln can load")
    return path
