"""Shared fixtures: tiny random Hugging Face models (built from configs, no downloads) with a small byte-level
tokenizer, and the transformers reference they are checked against. The one conftest.py of the suite: tests/<layer>/
mirror kiln/<layer>/, and pytest finds this file from every one of them (`from conftest import ...`)."""
from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parent.parent          # the repository
DATA = ROOT / "tests" / "data"
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"     # Triton's interpreter runs the GPU kernels on the CPU


def _interpreter_scalars_as_numpy_24_wants() -> None:
    """Triton 3.6's interpreter turns a kernel's scalar arguments into 1-element arrays and indexes with
    int(array), which NumPy 2.4 refuses for arrays of one dimension; loops over a runtime bound (range(0, K, ·))
    then fail. Its per-launch patch of tl.tensor.__index__ is wrapped to take the element."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


if INTERPRETING:
    _interpreter_scalars_as_numpy_24_wants()


@pytest.fixture
def gemv_products():
    """The GPU's quantized products with every fusion of the CUDA-core decode GEMV, whatever the defaults: int4
    gate/up rows are paired too (TritonOptions.silu_in_gemv), and int4 layers keep that GEMV's layout (int4_mma
    off)."""
    from kiln.kernels import TritonOptions
    from kiln.kernels.triton.quant_linear import QuantProducts

    return QuantProducts(TritonOptions(int4_mma="off", silu_in_gemv=(4, 8)))


MARKER = [7, 7, 7, 7]          # the prompt whose sampling failing_sampler breaks


@pytest.fixture
def failing_sampler(monkeypatch):
    """Sampling raises for the MARKER prompt only (tests/runtime/test_sampler_safety.py, and over HTTP
    tests/server/test_server_hardening.py)."""
    import kiln.runtime.sampler as sampler

    original = sampler.suppress_stop_tokens

    def failing(logits, request, seq):
        if request.prompt_token_ids == MARKER:
            raise ArithmeticError("injected sampling failure")
        return original(logits, request, seq)

    monkeypatch.setattr(sampler, "suppress_stop_tokens", failing)


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
VOCAB = 320  # 256 bytes + specials + unused rows, as real vocabularies have


def _common(**extra):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=256,
                eos_token_id=257, pad_token_id=257, initializer_range=0.05)
    base.update(extra)
    return base


def tiny_hf_configs():
    """name → transformers config of each architecture Kiln supports, with the features worth covering."""
    import transformers as tf

    return {
        "llama": tf.LlamaConfig(**_common()),
        "llama31_bias_tied": tf.LlamaConfig(**_common(
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
        "mistral": tf.MistralConfig(**_common(sliding_window=24, num_key_value_heads=1)),
        "qwen2": tf.Qwen2Config(**_common(tie_word_embeddings=True, num_key_value_heads=4)),
        "mixtral": tf.MixtralConfig(**_common(num_local_experts=4, num_experts_per_tok=2)),
    }


def make_tokenizer():
    """A byte-level BPE tokenizer without merges (every byte is a token) plus <s>, </s> and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    fast.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|system|>"]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model(name: str, path, seed: int = 0):
    import transformers as tf

    config = tiny_hf_configs()[name]
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return model


def tiny_mixtral(dtype: str):
    """The tiny Mixtral (seed 0) as a Kiln model in `dtype`, made in memory."""
    import transformers as tf

    from kiln.models import LlamaForCausalLM

    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(tiny_hf_configs()["mixtral"])
    return LlamaForCausalLM.from_hugging_face(hf, dtype=dtype)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """name → (hf_dir, transformers model) for every tiny architecture."""
    root = tmp_path_factory.mktemp("tiny")
    return {name: (root / name, save_tiny_model(name, root / name)) for name in tiny_hf_configs()}


@contextlib.contextmanager
def end_token_unset(model):
    """The transformers model with no end token while inside, restored after: the models of session fixtures are
    shared with tests that stop on it (and generate() fills an eos_token_id=None passed in a generation config from
    the model's own, so it must be unset on the model itself)."""
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        yield model
    finally:
        model.generation_config.eos_token_id = eos


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers greedy decoding, never stopping early."""
    with end_token_unset(model):
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                                                                    dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out - ref‖ / ‖ref‖ in float64, out finite and of ref's shape."""
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape and torch.isfinite(out).all()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


@torch.no_grad()
def hf_logits(model, prompt_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt_ids])).logits[0].float()


@pytest.fixture(scope="session")
def smollm2_path():
    from kiln.utils.default_model import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as err:
        pytest.fail(f"{err} (the test suite needs the embedded default model)")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """(transformers model, tokenizer) loading the same GGUF file, float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                 dtype=torch.float32).eval()
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2_model(smollm2_path):
    """The Kiln model imported from the GGUF file (imported once per session)."""
    from kiln.models import LlamaForCausalLM

    return LlamaForCausalLM.from_hugging_face(smollm2_path, quiet=True)


# --- a Triton kernel's test, on both backends -------------------------------------------------------------------
# Such a test takes `backend` first: "interpreter" (Triton's interpreter on the CPU, small shapes) or "cuda" (compiled
# on the GPU); DEVICE is where its tensors go. Interpreter cases (marker `interpreter`) run only in a process with
# TRITON_INTERPRET=1, which must be set before Triton is imported: tests/kernels/test_interpreter.py starts those.
DEVICE = {"interpreter": torch.device("cpu"), "cuda": torch.device("cuda")}


def interpreted(*values):
    """A case run by Triton's interpreter on the CPU."""
    return pytest.param("interpreter", *values, marks=pytest.mark.interpreter)


def on_gpu(*values, slow: bool = False):
    """A case compiled on the GPU: marker `gpu` (the default GPU run), or with slow=True `gpu_slow` (the sweep)."""
    return pytest.param("cuda", *values, marks=pytest.mark.gpu_slow if slow else pytest.mark.gpu)


# --- the GPU runs ---------------------------------------------------------------------------------------------------
# `pytest -m gpu`, the default GPU run (under 6 minutes on an H200), takes a few sharp cases of every kernel, dtype and
# quantized format and every end-to-end GPU check; `pytest -m gpu_slow` is the sweep (the other shapes, dtypes and
# layouts, the 32-layer 8B model, repeated runs). A case carries one of the two markers, never both.
def gpu_cases(cases: list, default: list) -> list:
    """A GPU test's cases (each a value, or a tuple of its arguments): those in `default` marked gpu, the others
    gpu_slow."""
    return [pytest.param(*(case if isinstance(case, tuple) else (case,)),
                         marks=pytest.mark.gpu if case in default else pytest.mark.gpu_slow) for case in cases]


@functools.cache
def random_smollm2(dtype: str, seed: int, quant_algo: str | None = None, kv_cache_quant_algo: str | None = None):
    """A SmolLM2-135M-shaped model of random weights (std 0.05), quantized as asked (2 calibration samples); made
    once a session: the GPU tests share them (AWQ's search takes a while on the CPU)."""
    from kiln.benchmark import shape_config
    from kiln.config import QuantConfig
    from kiln.models import LlamaForCausalLM
    from kiln.quantization import quantize_model

    model = LlamaForCausalLM.random(shape_config("smollm2-135m", dtype), seed=seed, std=0.05)
    if quant_algo or kv_cache_quant_algo:
        quantization = QuantConfig(quant_algo=quant_algo, kv_cache_quant_algo=kv_cache_quant_algo)
        model = quantize_model(model, quantization, calib_size=2, quiet=True)
    return model


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    not_interpreting = pytest.mark.skip(reason="runs under Triton's interpreter, in the process that "
                                               "tests/kernels/test_interpreter.py starts with TRITON_INTERPRET=1")
    gpu = torch.cuda.is_available()
    for item in items:
        if not gpu and (item.get_closest_marker("gpu") or item.get_closest_marker("gpu_slow")):
            item.add_marker(no_gpu)
        if not INTERPRETING and item.get_closest_marker("interpreter"):
            item.add_marker(not_interpreting)
