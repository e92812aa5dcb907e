"""Hugging Face model ids (issue 32, item 4): `LLM("org/name")` and `kiln convert --model_dir org/name` resolve
through huggingface_hub's cache. There is no network here: the cache is filled by hand in the hub's layout
(refs/<revision> → snapshots/<commit>/) and every run sets HF_HUB_OFFLINE=1, so a miss must say so."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln import LLM, SamplingConfig
from kiln.checkpoint import hub

ROOT = Path(__file__).resolve().parents[2]
COMMITS = {"main": "a" * 40, "v1": "b" * 40}


@pytest.fixture(scope="module")
def hub_cache(tiny_models, tmp_path_factory):
    """A hub cache holding kiln-test/tiny at main (the tiny Llama) and at v1 (the tiny Qwen2)."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--kiln-test--tiny"
    for (revision, commit), model in zip(COMMITS.items(), ("llama", "qwen2")):
        shutil.copytree(tiny_models[model][0], repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / revision).write_text(commit)
    return cache


def _offline(cache, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


GENERATE = """
import json, sys
from kiln import LLM, SamplingConfig
kwargs = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
with LLM("kiln-test/tiny", device="cpu", quiet=True, **kwargs) as llm:
    print(json.dumps(llm.generate([5, 6, 7], SamplingConfig(max_new_tokens=6, end_id=-1)).token_ids))
"""


def _tokens(model_dir) -> list[int]:
    with LLM(model_dir, device="cpu", quiet=True) as llm:
        return llm.generate([5, 6, 7], SamplingConfig(max_new_tokens=6, end_id=-1)).token_ids


def test_model_ids_resolve_from_the_cache_offline(hub_cache, tiny_models, tmp_path):
    for revision, model in ((None, "llama"), ("v1", "qwen2")):
        code = GENERATE.replace("sys.argv[1]) if len(sys.argv) > 1 else {}",
                                f"'{json.dumps({'revision': revision} if revision else {})}')")
        done = _offline(hub_cache, code)
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout.strip().splitlines()[-1]) == _tokens(tiny_models[model][0])
    done = _offline(hub_cache, "from kiln.cli.main import main; import sys; "
                               f"sys.exit(main(['convert', '--model_dir', 'kiln-test/tiny', '--output_dir', "
                               f"'{tmp_path / 'ckpt'}']))")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["architecture"] == "LlamaForCausalLM"


def test_a_model_the_cache_lacks_is_named_offline(hub_cache):
    done = _offline(hub_cache, "from kiln import LLM; LLM('kiln-test/absent', device='cpu', quiet=True)")
    assert done.returncode != 0
    assert "'kiln-test/absent' is neither a local path nor in the Hugging Face hub cache" in done.stderr
    done = _offline(hub_cache, "from kiln import LLM; LLM('kiln-test/tiny', revision='v9', device='cpu', quiet=True)")
    assert done.returncode != 0 and "kiln-test/tiny" in done.stderr.splitlines()[-1]


def test_revision_applies_to_model_ids_only(tiny_models):
    assert hub.is_model_id("org/name") and not hub.is_model_id("org/name/extra")
    assert not hub.is_model_id(str(tiny_models["llama"][0]))
    with pytest.raises(ValueError, match="revision='v1' applies to Hugging Face model ids"):
        LLM(tiny_models["llama"][0], revision="v1", device="cpu", quiet=True)
