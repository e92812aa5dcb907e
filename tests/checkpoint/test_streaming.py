"""Memory never doubles: safetensors files written a tensor at a time equal save_file's, lazy weights give the
whole-model path's tensors bit for bit, and converting (plain and quantized) and building a ~1 GB model each
raise a process's peak memory by less than a quarter of the model."""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save, save_file

from kiln import BuildConfig, build
from kiln.checkpoint.lazy import materialize
from kiln.checkpoint.random_weights import random_weights
from kiln.checkpoint.safetensors_file import TensorReader, TensorWriter, write_tensors
from kiln.cli.main import main
from kiln.config import PretrainedConfig, QuantConfig
from kiln.convert import convert
from kiln.models import LlamaForCausalLM
from kiln.quantization import quantize_model
from kiln.utils import checksum


def test_written_files_equal_save_file(tmp_path, monkeypatch):
    """Every dtype, empty and 0-d tensors, tensors given in any order: the bytes save_file writes; the digest taken
    while writing (here over 64-byte chunks) equals the file's."""
    monkeypatch.setattr(checksum, "CHUNK", 64)
    tensors = {"b.weight": torch.arange(6, dtype=torch.int8).reshape(2, 3), "a": torch.randn(3, 5),
               "scale": torch.tensor(2.5), "empty": torch.zeros(0, 4), "c": torch.randn(7).to(torch.bfloat16),
               "h": torch.randn(2, 2).half(), "f8": torch.randn(9).to(torch.float8_e4m3fn),
               "u": torch.arange(5, dtype=torch.uint8), "i": torch.arange(3, dtype=torch.int64)}
    for metadata in ({"format": "pt"}, None):
        save_file(tensors, tmp_path / "reference.safetensors", metadata=metadata)
        digest = write_tensors(tmp_path / "written.safetensors", dict(reversed(tensors.items())), metadata)
        assert (tmp_path / "written.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
        assert digest == checksum.file_digest(tmp_path / "written.safetensors")
    with TensorReader(tmp_path / "written.safetensors") as f:
        for name, tensor in tensors.items():
            read = f.read(name)
            assert read.shape == tensor.shape and torch.equal(read.reshape(-1).view(torch.uint8),
                                                              tensor.reshape(-1).view(torch.uint8))
    writer = TensorWriter(tmp_path / "partial.safetensors", {"a": torch.zeros(2)}, None)
    with pytest.raises(ValueError, match="'a' is \\(3,\\) float32, expected \\(2,\\) float32"):
        writer.write("a", torch.zeros(3))
    with pytest.raises(ValueError, match="'a' was never written"):
        writer.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_file_read_whole_in_chunks_gives_its_tensors_and_digest(tmp_path, monkeypatch, device):
    """read_all over 64-byte chunks by three threads: every tensor bit for bit (on `device`) and the file's digest;
    a file whose tensors leave a gap in its data section is read a tensor at a time, with the same results."""
    import kiln.checkpoint.safetensors_file as safetensors_file

    monkeypatch.setattr(checksum, "CHUNK", 64)
    monkeypatch.setattr(safetensors_file, "CHUNK", 64)
    tensors = {"a": torch.randn(30, 7), "b": torch.randn(3).half(), "empty": torch.zeros(0, 2), "s": torch.tensor(2.5),
               "f8": torch.randn(41).to(torch.float8_e4m3fn), "i": torch.arange(9, dtype=torch.int64)}
    save_file(tensors, tmp_path / "whole.safetensors")
    gap = bytearray((tmp_path / "whole.safetensors").read_bytes())
    (length,) = struct.unpack("<Q", gap[:8])
    header = json.loads(gap[8:8 + length])
    data = gap[8 + length:]
    start, stop = header["i"]["data_offsets"]
    header["i"]["data_offsets"] = [len(data) + 8, len(data) + 8 + stop - start]   # 8 bytes no tensor owns, then i
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (tmp_path / "gap.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + data + bytes(8) +
                                               data[start:stop])
    for name in ("whole", "gap"):
        with TensorReader(tmp_path / f"{name}.safetensors") as f:
            read, digest = f.read_all(device, hash_file=True, threads=3)
        assert digest == checksum.file_digest(tmp_path / f"{name}.safetensors")
        assert set(read) == set(tensors)
        for key, tensor in tensors.items():
            assert read[key].device.type == device and read[key].dtype == tensor.dtype
            assert read[key].shape == tensor.shape and torch.equal(read[key].cpu().reshape(-1).view(torch.uint8),
                                                                   tensor.reshape(-1).view(torch.uint8)), key


def test_random_weights_are_the_same_in_any_order():
    config = PretrainedConfig(architecture="LlamaForCausalLM", dtype="bfloat16", vocab_size=64, hidden_size=32,
                              num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    whole = LlamaForCausalLM.random(config, seed=3).weights
    lazy = random_weights(config, seed=3)
    for name in reversed(list(whole)):
        assert torch.equal(lazy[name], whole[name]), name
    assert all(torch.equal(t, whole[n]) for n, t in lazy.items())


@pytest.mark.parametrize("name", ["llama31_bias_tied", "mixtral", "qwen2"])
def test_kiln_convert_and_build_equal_the_whole_model_path(name, tiny_models, tmp_path):
    """kiln convert (plain, sharded, quantized) and kiln build stream; their files hold the whole model's tensors
    bit for bit: the checkpoints' bytes are save_file's of the whole-model path."""
    hf_dir, _ = tiny_models[name]
    model = LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True)
    flags = [["--dtype", "float32"], ["--tp_size", "2"],
             ["--use_weight_only", "--weight_only_precision", "int4_awq", "--per_group", "--group_size", "32",
              "--calib_size", "2"]]
    for index, extra in enumerate(flags):
        out = tmp_path / f"ckpt{index}"
        assert main(["convert", "--model_dir", str(hf_dir), "--output_dir", str(out), *extra]) == 0
        whole = model
        if "--use_weight_only" in extra:
            whole = convert(hf_dir, quant_config=QuantConfig("W4A16_AWQ", group_size=32, has_zero_point=True),
                            calib_size=2, quiet=True)
        ranks = [whole] if "--tp_size" not in extra else [whole.shard(m) for m in _tp2()]
        for rank, part in enumerate(ranks):
            save_file(part.weights, tmp_path / "reference.safetensors", metadata={"format": "pt"})
            assert (out / f"rank{rank}.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    assert main(["build", "--checkpoint_dir", str(tmp_path / "ckpt0"), "--output_dir", str(tmp_path / "engine"),
                 "--max_input_len", "16", "--max_seq_len", "32"]) == 0
    engine = build(model, BuildConfig(max_input_len=16, max_seq_len=32), quiet=True)
    _assert_same_file_as_save_file(tmp_path / "engine" / "rank0.safetensors", engine.weights[0])


def _tp2():
    from kiln.config import Mapping

    return [Mapping(2, rank, 2, 1) for rank in range(2)]


def _assert_same_file_as_save_file(path, weights: dict) -> None:
    """The same header (save_file orders its metadata arbitrarily) and the same tensor bytes."""
    reference = save(weights, metadata={"kiln": "x"})
    data = path.read_bytes()
    (ours,), (theirs,) = struct.unpack("<Q", data[:8]), struct.unpack("<Q", reference[:8])
    header, expected = json.loads(data[8:8 + ours]), json.loads(reference[8:8 + theirs])
    header.pop("__metadata__"), expected.pop("__metadata__")
    assert header == expected and data[8 + ours:] == reference[8 + theirs:]


# ------------------------------------------------------------------------------------------- peak memory, ~1 GB
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4)
TINY_SHAPE = dict(SHAPE, vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2)


def write_random_hf_model(path, shape: dict, dtype: torch.dtype = torch.float16, seed: int = 0) -> int:
    """A Llama HF directory of random weights of `shape`, written a tensor at a time; returns its weights' bytes."""
    from kiln.checkpoint.lazy import TensorSpec

    h, inter, heads, kv = (shape[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                              "num_key_value_heads"))
    kv_rows = h // heads * kv
    specs = {"model.embed_tokens.weight": (shape["vocab_size"], h), "model.norm.weight": (h,),
             "lm_head.weight": (shape["vocab_size"], h)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                      p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv_rows, h),
                      p + "self_attn.v_proj.weight": (kv_rows, h), p + "self_attn.o_proj.weight": (h, h),
                      p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                      p + "mlp.down_proj.weight": (h, inter)})
    path.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    writer = TensorWriter(path / "model.safetensors", {n: TensorSpec(s, dtype) for n, s in specs.items()},
                          {"format": "pt"})
    for name, s in specs.items():
        writer.write(name, torch.ones(s, dtype=dtype) if len(s) == 1 else
                     (torch.randn(s, generator=generator) * 0.02).to(dtype))
    writer.close()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": str(dtype)[6:],
              "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, **shape}
    (path / "config.json").write_text(json.dumps(config))
    return sum(torch.Size(s).numel() for s in specs.values()) * dtype.itemsize


PEAK = ("import resource, sys; from kiln.cli.main import main; rc = main(sys.argv[1:]); "
        "print('peak', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, flush=True); sys.exit(rc)")


def peak_rss(*args: str) -> int:
    """Peak resident memory (bytes) of `kiln ARGS` run in a process of its own."""
    run = subprocess.run([sys.executable, "-c", PEAK, *args], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return int(run.stdout.split("peak")[-1])


COMMANDS = {
    "convert": ["convert", "--model_dir", "{hf}", "--output_dir", "{out}/ckpt"],
    "convert W8A16 round to nearest": ["convert", "--model_dir", "{hf}", "--output_dir", "{out}/ckpt_w8",
                                       "--use_weight_only", "--round_to_nearest"],
    "build": ["build", "--checkpoint_dir", "{out}/ckpt", "--output_dir", "{out}/engine", "--max_input_len", "16",
              "--max_seq_len", "32"],
}


@pytest.mark.slow
def test_converting_and_building_hold_a_fraction_of_the_model(tmp_path):
    """Each command's peak memory, beyond that of the same command on a tiny model (the interpreter, torch and
    Kiln's imports), stays under a quarter of the ~1 GB model; the files equal the whole-model path's."""
    size = write_random_hf_model(tmp_path / "hf", SHAPE)
    write_random_hf_model(tmp_path / "tiny_hf", TINY_SHAPE)
    for what, args in COMMANDS.items():
        bare = peak_rss(*(a.format(hf=tmp_path / "tiny_hf", out=tmp_path / "tiny") for a in args))
        peak = peak_rss(*(a.format(hf=tmp_path / "hf", out=tmp_path) for a in args))
        print(f"{what}: +{(peak - bare) / 2**20:.0f} MiB over a tiny model's run for a {size / 2**20:.0f} MiB model")
        assert peak - bare < 0.25 * size, (what, peak - bare, size)
    model = LlamaForCausalLM.from_hugging_face(tmp_path / "hf", quiet=True)
    _assert_rank_file(tmp_path / "ckpt", model.weights)
    _assert_rank_file(tmp_path / "ckpt_w8", quantize_model(model, QuantConfig("W8A16"), quiet=True,
                                                            round_to_nearest=True).weights)
    _assert_same_file_as_save_file(tmp_path / "engine" / "rank0.safetensors", materialize(model.engine_weights()))


def _assert_rank_file(ckpt, weights: dict) -> None:
    assert (ckpt / "rank0.safetensors").read_bytes() == save(weights, metadata={"format": "pt"})
