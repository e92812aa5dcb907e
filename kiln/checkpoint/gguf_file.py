"""GGUF files (llama.cpp) → PretrainedConfig and dequantised tensors in the Kiln checkpoint layout."""
from __future__ import annotations

import functools
import math
import mmap
import re
import struct
from pathlib import Path

import numpy as np
import torch

from kiln.config import PretrainedConfig

from .layout import check_finite
from .lazy import LazyWeights, TensorSpec, unit_key

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_NAMES = [
    (re.compile(r"token_embd\.weight"), "embed_tokens.weight"),
    (re.compile(r"output_norm\.weight"), "norm.weight"),
    (re.compile(r"output\.weight"), "lm_head.weight"),
    (re.compile(r"blk\.(\d+)\.attn_norm\.weight"), r"layers.\1.input_norm.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_norm\.weight"), r"layers.\1.post_attn_norm.weight"),
    (re.compile(r"blk\.(\d+)\.attn_q\.(weight|bias)"), r"layers.\1.attn.q_proj.\2"),
    (re.compile(r"blk\.(\d+)\.attn_k\.(weight|bias)"), r"layers.\1.attn.k_proj.\2"),
    (re.compile(r"blk\.(\d+)\.attn_v\.(weight|bias)"), r"layers.\1.attn.v_proj.\2"),
    (re.compile(r"blk\.(\d+)\.attn_output\.(weight|bias)"), r"layers.\1.attn.o_proj.\2"),
    (re.compile(r"blk\.(\d+)\.ffn_gate\.weight"), r"layers.\1.mlp.gate_proj.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_up\.weight"), r"layers.\1.mlp.up_proj.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_down\.weight"), r"layers.\1.mlp.down_proj.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight"), r"layers.\1.moe.router.weight"),
    (re.compile(r"blk\.(\d+)\.ffn_gate_exps\.weight"), r"layers.\1.moe.gate_proj"),
    (re.compile(r"blk\.(\d+)\.ffn_up_exps\.weight"), r"layers.\1.moe.up_proj"),
    (re.compile(r"blk\.(\d+)\.ffn_down_exps\.weight"), r"layers.\1.moe.down_proj"),
]


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file at `path` (a file, or a directory holding exactly one); None when there is none."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    files = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(files) > 1:
        raise ValueError(f"{str(path)!r} holds {len(files)} GGUF files; name one of them")
    return files[0] if files else None


def _reader(path: Path):
    """Parsing the metadata takes seconds (the vocabulary), so config and weights share one reader."""
    stat = path.stat()
    return _cached_reader(str(path.absolute()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int):
    from gguf import GGUFReader

    check_gguf_sizes(Path(path))
    try:
        return GGUFReader(path)
    except Exception as err:  # the reader raises ValueError/struct errors/IndexError on damaged files
        raise ValueError(f"{path}: corrupt or truncated GGUF file ({err})") from None


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # GGUFValueType → size
_STRING, _ARRAY = 8, 9
_LEAST_BYTES = {**_SCALAR_BYTES, _STRING: 8, _ARRAY: 12}     # the smallest encoding of one value of a type


def check_gguf_sizes(path: Path) -> None:
    """Walk a GGUF file's header, checking every count and length against the file's real size before the gguf
    reader allocates by them: a 60-byte file declaring a 2^40-item array fails here at once, naming the field."""
    size = path.stat().st_size
    if size < 24:
        raise ValueError(f"{path}: corrupt or truncated GGUF file ({size} bytes, shorter than its header)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        header = _Header(data, path)
        tensor_count, kv_count = header.unpack("Q", "tensor count"), header.unpack("Q", "metadata count")
        header.require(kv_count * 13, f"{kv_count} metadata entries")
        alignment = 32
        for _ in range(kv_count):
            key = header.string("metadata key")
            value_type = header.unpack("I", key)
            if key == "general.alignment" and value_type == 4:
                alignment = struct.unpack_from(header.order + "I", data, header.pos)[0] or 1
            header.skip_value(value_type, key)
        header.require(tensor_count * 24, f"{tensor_count} tensors")
        tensors = [header.tensor_info() for _ in range(tensor_count)]
        data_start = -(-header.pos // alignment) * alignment
        for name, dims, tensor_type, offset in tensors:
            _check_tensor_data(path, size, name, dims, tensor_type, data_start + offset)


class _Header:
    """Reads a GGUF header from the start, refusing to read past the end of the file."""

    def __init__(self, data, path: Path):
        if bytes(data[:4]) != b"GGUF":
            raise ValueError(f"{path}: corrupt or truncated GGUF file (no GGUF magic)")
        self.order = "<" if struct.unpack_from("<I", data, 4)[0] & 0xFFFF else ">"   # byte-swapped files
        self.data, self.path, self.pos = data, path, 8      # after the magic and the version

    def require(self, n: int, what: str) -> None:
        left = len(self.data) - self.pos
        if n > left:
            raise ValueError(f"{self.path}: corrupt GGUF file: {what}: at least {n} bytes from offset {self.pos}, "
                             f"but the {len(self.data)}-byte file has {left} left")

    def take(self, n: int, what: str) -> int:
        self.require(n, what)
        self.pos += n
        return self.pos - n

    def unpack(self, fmt: str, what: str) -> int:
        return struct.unpack_from(self.order + fmt, self.data, self.take(struct.calcsize(fmt), repr(what)))[0]

    def string(self, what: str) -> str:
        n = self.unpack("Q", what)
        start = self.take(n, f"{what} ({n}-byte string)")
        return bytes(self.data[start:start + n]).decode("utf-8", "replace")

    def skip_value(self, value_type: int, key: str, depth: int = 0) -> None:
        if value_type in _SCALAR_BYTES:
            self.take(_SCALAR_BYTES[value_type], repr(key))
        elif value_type == _STRING:
            self.take(self.unpack("Q", key), repr(key))
        elif value_type == _ARRAY and depth < 2:
            item_type, count = self.unpack("I", key), self.unpack("Q", key)
            if item_type not in _LEAST_BYTES:
                raise ValueError(f"{self.path}: corrupt GGUF file: metadata {key!r} has items of unknown type "
                                 f"{item_type}")
            self.require(count * _LEAST_BYTES[item_type], f"the {count} items of metadata {key!r}")
            if item_type in _SCALAR_BYTES:
                self.take(count * _SCALAR_BYTES[item_type], repr(key))
            else:
                for _ in range(count):
                    self.skip_value(item_type, key, depth + 1)
        else:
            raise ValueError(f"{self.path}: corrupt GGUF file: metadata {key!r} has unknown or too deeply nested "
                             f"type {value_type}")

    def tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self.string("tensor name")
        n_dims = self.unpack("I", f"tensor {name}")
        if n_dims > 4:
            raise ValueError(f"{self.path}: corrupt GGUF file: tensor {name!r} has {n_dims} dimensions (GGUF allows 4)")
        dims = [self.unpack("Q", f"tensor {name}") for _ in range(n_dims)]
        return name, dims, self.unpack("I", f"tensor {name}"), self.unpack("Q", f"tensor {name}")


def _check_tensor_data(path: Path, size: int, name: str, dims: list[int], tensor_type: int, start: int) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(tensor_type)]
    except (ValueError, KeyError):
        raise ValueError(f"{path}: tensor {name!r} has unknown GGML type {tensor_type}") from None
    n_bytes = math.prod(dims) * block_bytes // block
    if start + n_bytes > size:
        raise ValueError(f"{path}: corrupt or truncated GGUF file: tensor {name!r} of shape {dims} needs {n_bytes} "
                         f"bytes at offset {start}, past the end of the {size}-byte file")


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf_config(path: Path, dtype: str = "auto") -> PretrainedConfig:
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; Kiln imports {', '.join(_ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path}: GGUF rope_freqs (Llama 3.1 rope scaling) is not supported; convert the HF model")
    experts = _field(reader, f"{arch}.expert_count", 0) or 0
    heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    return PretrainedConfig(
        architecture="MixtralForCausalLM" if experts else _ARCHITECTURES[arch],
        dtype="float32" if dtype == "auto" else dtype, vocab_size=vocab, hidden_size=hidden,
        num_hidden_layers=_field(reader, f"{arch}.block_count"), num_attention_heads=heads,
        num_key_value_heads=_field(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=_field(reader, f"{arch}.attention.key_length", None) or _field(reader, f"{arch}.rope.dimension_count", None) or hidden // heads,
        intermediate_size=_field(reader, f"{arch}.expert_feed_forward_length", None) or _field(reader, f"{arch}.feed_forward_length"),
        norm_epsilon=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rotary_base=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch),
        max_position_embeddings=_field(reader, f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        moe_num_experts=experts, moe_top_k=_field(reader, f"{arch}.expert_used_count", 0) or 0)


def _rope_scaling(reader, arch: str) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    if kind != "linear":
        raise ValueError(f"GGUF rope scaling {kind!r} is not supported; supported: linear")
    return {"type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}


def gguf_weights(path: Path, config: PretrainedConfig) -> LazyWeights:
    """The tensors of a GGUF file in the Kiln layout, each dequantised when it is used (the file is memory-mapped
    by the gguf reader), renamed, with llama.cpp's q/k row permutation undone, cast to config.dtype."""
    reader = _reader(path)
    permute_qk = _field(reader, "general.architecture") == "llama"
    dtype = _DTYPES[config.dtype]
    tensors = {_rename(t.name, path): t for t in reader.tensors}
    specs = {name: TensorSpec(tuple(int(d) for d in reversed(t.shape)), dtype) for name, t in tensors.items()}

    def make(names: list[str]) -> dict[str, torch.Tensor]:
        from gguf.quants import dequantize

        name, t = names[0], tensors[names[0]]
        array = dequantize(t.data, t.tensor_type)
        tensor = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(specs[name].shape)
        if permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = _unpermute(tensor, config.num_attention_heads)
        elif permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = _unpermute(tensor, config.num_key_value_heads)
        tensor = tensor.to(dtype)
        check_finite(t.name, tensor, path)
        return {name: tensor}

    units = [[name] for name in sorted(specs, key=lambda n: (unit_key(n), n))]
    return LazyWeights(specs, units, make, str(path))


def has_tokenizer(path: Path) -> bool:
    return _field(_reader(path), "tokenizer.ggml.model") is not None


def _rename(name: str, path: Path) -> str:
    for pattern, replacement in _NAMES:
        if pattern.fullmatch(name):
            return pattern.sub(replacement, name)
    raise ValueError(f"{path}: unexpected GGUF tensor {name!r}")


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp interleaves the two rotary halves of each head's rows; restore HF's half-split order."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
