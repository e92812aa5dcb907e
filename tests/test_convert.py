"""kiln/convert.py, the one place loading meets quantization: what it checks before reading weights, what it
refuses, and a load → quantize → save round trip of random weights."""
from __future__ import annotations

import pytest

from kiln.config import ConvertConfig, QuantConfig
from kiln.convert import convert, convert_checkpoint, quantize
from kiln.models import LlamaForCausalLM

SHAPE = dict(vocab_size=64, n_layer=2, n_head=4, n_embd=64, inter_size=128)


def test_shapes_are_checked_before_any_weight_is_read(tiny_models, monkeypatch):
    hf_dir, _ = tiny_models["llama"]
    monkeypatch.setattr("kiln.models.base.read_source_weights", lambda *a: pytest.fail("weights were read"))
    with pytest.raises(ValueError, match="checkpoint.n_layer=7 disagrees with the model's num_hidden_layers"):
        convert(hf_dir, convert_config=ConvertConfig(n_layer=7), quiet=True)


def test_quantization_is_asked_for_once():
    with pytest.raises(ValueError, match="give it, or quant_config and calib_size, not both"):
        convert(None, convert_config=ConvertConfig(**SHAPE), quant_config=QuantConfig("W8A16"))
    with pytest.raises(ValueError, match="a convert_config must describe the model's shape"):
        convert(None, quant_config=QuantConfig("W8A16"))


def test_random_weights_convert_quantize_and_save(tmp_path):
    config = ConvertConfig(**SHAPE, use_weight_only=True, calib_size=1, tp_size=2, use_parallel_embedding=True)
    convert_checkpoint(None, tmp_path / "ckpt", convert_config=config, quiet=True)
    rank1 = LlamaForCausalLM.from_checkpoint(tmp_path / "ckpt", rank=1)
    assert rank1.config.quantization.quant_algo == "W8A16" and rank1.config.use_parallel_embedding
    assert rank1.config.mapping.tp_rank == 1
    plain = convert(None, convert_config=ConvertConfig(**SHAPE))
    assert quantize(plain, QuantConfig()) is plain and not plain.config.quantization.enabled
