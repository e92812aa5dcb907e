"""Files on disk: output directories never delete what is not Kiln's own, writes survive a kill, small hostile files
fail at once, and weights are verified (checksums, dtypes, shapes, NaN) before they answer anything."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import save_tiny_model
from kiln import LLM, BuildConfig, Engine, build
from kiln.cli.main import main
from kiln.models import LlamaForCausalLM
from kiln.utils.checksum import ALGORITHM, directory_checksums
from kiln.utils.fs import atomic_dir, require_dir

SMALL = BuildConfig(max_batch_size=2, max_input_len=16, max_seq_len=32)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("files") / "hf"
    save_tiny_model("llama", path)
    return path


@pytest.fixture(scope="module")
def engine_dir(hf_dir):
    path = hf_dir.parent / "engine"
    build(LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True), SMALL, quiet=True).save(path)
    return path


@pytest.fixture(scope="module")
def ckpt_dir(hf_dir):
    return LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True).save_checkpoint(hf_dir.parent / "ckpt")


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


# --- output directories (7a) -----------------------------------------------------------------------------------

def _no_loading(monkeypatch):
    """Fail the test if a model is loaded: the CLI must refuse before any work."""
    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the output directory was checked")

    monkeypatch.setattr(LlamaForCausalLM, "from_hugging_face", loaded)
    monkeypatch.setattr(LlamaForCausalLM, "from_checkpoint", loaded)


def test_build_keeps_a_directory_of_user_files(hf_dir, tmp_path, monkeypatch, capsys):
    (tmp_path / "d2" / "sub").mkdir(parents=True)
    (tmp_path / "d2" / "sub" / "notes.txt").write_text("mine")
    with monkeypatch.context() as patch:
        _no_loading(patch)
        assert main(["build", "--model_dir", str(hf_dir), "--output_dir", str(tmp_path / "d2")]) == 2
    assert "is not empty and is not a kiln-engine" in capsys.readouterr().err
    assert (tmp_path / "d2" / "sub" / "notes.txt").read_text() == "mine"
    assert main(["build", "--model_dir", str(hf_dir), "--output_dir", str(tmp_path / "d2"), "--overwrite",
                 "--max_batch_size", "2", "--max_input_len", "16", "--max_seq_len", "32"]) == 0
    assert not (tmp_path / "d2" / "sub").exists() and Engine.from_dir(tmp_path / "d2")


def test_convert_never_writes_over_its_input(hf_dir, tmp_path, monkeypatch, capsys):
    shutil.copytree(hf_dir, tmp_path / "x")
    _no_loading(monkeypatch)
    for output, extra in ((tmp_path / "x", []), (tmp_path / "x", ["--overwrite"]), (tmp_path, ["--overwrite"]),
                          (tmp_path / "x" / "ckpt", [])):
        assert main(["convert", "--model_dir", str(tmp_path / "x"), "--output_dir", str(output), *extra]) == 2
        assert "would overwrite the input" in capsys.readouterr().err
    assert (tmp_path / "x" / "model.safetensors").is_file()


def test_missing_output_dir_is_reported_before_the_build(hf_dir, monkeypatch, capsys):
    _no_loading(monkeypatch)
    assert main(["build", "--model_dir", str(hf_dir)]) == 2
    assert "--output_dir is required" in capsys.readouterr().err


def test_only_empty_dirs_and_outputs_of_the_same_kind_are_replaced(hf_dir, engine_dir, ckpt_dir, tmp_path):
    model = LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True)
    engine = build(model, SMALL, quiet=True)
    (tmp_path / "empty").mkdir()
    engine.save(tmp_path / "empty")
    shutil.copytree(engine_dir, tmp_path / "engine")
    engine.save(tmp_path / "engine")
    shutil.copytree(ckpt_dir, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="is not a kiln-engine"):
        engine.save(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="is not a kiln-checkpoint"):
        model.save_checkpoint(tmp_path / "engine")
    model.save_checkpoint(tmp_path / "ckpt")
    assert Engine.from_dir(tmp_path / "empty") and Engine.from_dir(tmp_path / "engine")
    assert not _leftovers(tmp_path)


# --- crash-safe atomic directories (7) --------------------------------------------------------------------------

_PATCHES = {
    "while writing": "",
    "after exchange": "fs.shutil.rmtree = lambda *args, **kwargs: os._exit(9)",
    "between renames": """
fs._exchange = lambda a, b: False        # a system without renameat2: the old directory renamed away, then the new in
rename = pathlib.Path.rename
def rename_then_die(self, to):
    rename(self, to)
    if ".old-" in str(to):
        os._exit(9)
pathlib.Path.rename = rename_then_die
""",
}


def _die_during(write: str, at: str) -> None:
    """Run `write` in a child process that dies by os._exit (as by a kill: nothing cleans up) at `at`."""
    script = "import os, pathlib\nfrom kiln.utils import fs\n" + _PATCHES[at] + "\n" + textwrap.dedent(write)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 9, done.stderr


def _write_v1_then_die_writing_v2(target: Path, at: str) -> None:
    with atomic_dir(target) as tmp:
        (tmp / "version").write_text("v1")
    _die_during(f"""
        with fs.atomic_dir({str(target)!r}) as tmp:
            (tmp / "version").write_text("v2")
            (tmp / "weights").write_bytes(bytes(1 << 20))
            if {at!r} == "while writing":
                os._exit(9)
    """, at)


@pytest.mark.parametrize("at, expected", [("while writing", "v1"), ("after exchange", "v2")])
def test_killed_write_keeps_a_whole_directory_and_its_leftovers_go(tmp_path, at, expected):
    target = tmp_path / "out"
    _write_v1_then_die_writing_v2(target, at)
    assert (target / "version").read_text() == expected
    assert _leftovers(tmp_path)                            # the killed writer's temporary directory ...
    with atomic_dir(target) as tmp:
        (tmp / "version").write_text("v3")
    assert (target / "version").read_text() == "v3"
    assert not _leftovers(tmp_path)                        # ... is removed by the next write


def test_kill_between_the_two_renames_is_recovered_at_the_next_load(tmp_path):
    target = tmp_path / "out"
    _write_v1_then_die_writing_v2(target, "between renames")
    assert not target.exists() and any(".old-" in name for name in _leftovers(tmp_path))
    assert (require_dir(target, "engine directory") / "version").read_text() == "v1"
    assert not _leftovers(tmp_path)


def test_engine_killed_while_replaced_is_restored_when_run(engine_dir, tmp_path, capsys):
    shutil.copytree(engine_dir, tmp_path / "engine")
    _die_during(f"""
        from kiln import Engine
        Engine.from_dir({str(engine_dir)!r}).save({str(tmp_path / "engine")!r})
    """, "between renames")
    assert not (tmp_path / "engine").exists()
    assert main(["run", "--engine_dir", str(tmp_path / "engine"), "--max_new_tokens", "1", "hi"]) == 0
    assert "restored from .engine.old-" in capsys.readouterr().err and not _leftovers(tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")
def test_the_swap_is_one_step_on_linux(tmp_path):
    from kiln.utils import fs

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "name").write_text(name)
    assert fs._exchange(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "a" / "name").read_text() == "b" and (tmp_path / "b" / "name").read_text() == "a"


def test_temporary_dirs_of_running_writers_are_kept(tmp_path):
    running = tmp_path / f".out.tmp-{os.getpid()}-0123abcd"
    running.mkdir()
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "version").write_text("v1")
    assert running.is_dir()


def test_output_dirs_and_files_follow_the_umask(hf_dir, tmp_path):
    old = os.umask(0o027)
    try:
        LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True).save_checkpoint(tmp_path / "ckpt")
    finally:
        os.umask(old)
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o750
    assert (tmp_path / "ckpt" / "rank0.safetensors").stat().st_mode & 0o777 == 0o640


# --- small hostile files (8) ------------------------------------------------------------------------------------

def _run_limited(code: str, memory_gib: int = 4, timeout: int = 120) -> subprocess.CompletedProcess:
    """`code` in a child process limited to `memory_gib` of address space: a regression fails, not the machine."""
    prelude = (f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({memory_gib << 30}, {memory_gib << 30}))\n")
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=Path(__file__).parent)


def _expect_error(code: str, *fragments: str) -> None:
    done = _run_limited(code)
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    assert done.returncode == 1 and last.startswith("ValueError"), done.stderr[-2000:]
    for fragment in fragments:
        assert fragment in last, last


def test_gguf_declaring_a_huge_array_fails_at_once(tmp_path):
    key = b"tokenizer.ggml.tokens"
    data = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
            + struct.pack("<IIQ", 9, 0, 2**40))                 # an array of 2^40 uint8 in a 57-byte file
    (tmp_path / "m.gguf").write_bytes(data)
    _expect_error(f"""
        from kiln.checkpoint import read_source_config
        read_source_config({str(tmp_path / "m.gguf")!r})
    """, "tokenizer.ggml.tokens", "1099511627776 items")


def test_gguf_tensor_past_the_end_of_the_file_is_named(tmp_path):
    name = b"token_embd.weight"
    data = (b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + struct.pack("<Q", len(name)) + name
            + struct.pack("<IQQIQ", 2, 2**20, 2**20, 0, 0))      # a 1M x 1M float32 tensor, no data
    (tmp_path / "m.gguf").write_bytes(data)
    _expect_error(f"""
        from kiln.checkpoint.gguf_file import check_gguf_sizes
        import pathlib
        check_gguf_sizes(pathlib.Path({str(tmp_path / "m.gguf")!r}))
    """, "token_embd.weight", "past the end")


def test_hf_config_claiming_millions_of_layers_fails_at_once(hf_dir, tmp_path):
    shutil.copytree(hf_dir, tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 10**7}))
    _expect_error(f"""
        from kiln.models import LlamaForCausalLM
        LlamaForCausalLM.from_hugging_face({str(tmp_path / "m")!r}, quiet=True)
    """, "num_hidden_layers=10000000", "layers 0..1")


def _forge_engine(engine_dir: Path, out: Path, pretrained: dict = None, build_fields: dict = None,
                  weights=None) -> Path:
    """A copy of the engine with edited configs or tensors whose hash, rank metadata and checksums are all
    recomputed: what an attacker, or a careless script, can write."""
    from safetensors.torch import load_file, save_file

    from kiln.builder.engine import engine_hash
    from kiln.config import BuildConfig, PretrainedConfig

    shutil.copytree(engine_dir, out)
    manifest = json.loads((out / "config.json").read_text())
    manifest["pretrained_config"].update(pretrained or {})
    manifest["build_config"].update(build_fields or {})
    manifest["hash"] = engine_hash(PretrainedConfig.from_dict(manifest["pretrained_config"]),
                                   BuildConfig.from_dict(manifest["build_config"]))
    tensors = load_file(out / "rank0.safetensors")
    save_file(weights(tensors) if weights else tensors, out / "rank0.safetensors",
              metadata={"kiln_engine_hash": manifest["hash"], "rank": "0"})
    manifest["checksums"] = directory_checksums(out)
    (out / "config.json").write_text(json.dumps(manifest))
    return out


def test_engine_config_claiming_a_million_layers_fails_at_once(engine_dir, tmp_path):
    forged = _forge_engine(engine_dir, tmp_path / "e", pretrained={"num_hidden_layers": 10**6})
    _expect_error(f"""
        from kiln import LLM
        LLM({str(forged)!r}, device="cpu")
    """, "num_hidden_layers=1000000")


def test_engine_with_an_absurd_max_seq_len_fails_naming_it(engine_dir, tmp_path):
    forged = _forge_engine(engine_dir, tmp_path / "e", pretrained={"max_position_embeddings": 10**9},
                           build_fields={"max_seq_len": 10**9, "max_input_len": 10**9 - 16, "max_output_len": 16,
                                         "max_num_tokens": 10**9 - 16})
    _expect_error(f"""
        from kiln import LLM
        LLM({str(forged)!r}, device="cpu")
    """, "max_seq_len=1000000000")


def test_hf_config_fields_are_checked(hf_dir, tmp_path):
    shutil.copytree(hf_dir, tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    for edit, message in (({"num_hidden_layers": 2.0}, "num_hidden_layers must be an integer"),
                          ({"hidden_size": "64"}, "hidden_size must be an integer")):
        (tmp_path / "m" / "config.json").write_text(json.dumps({**raw, **edit}))
        with pytest.raises(ValueError, match=message):
            LlamaForCausalLM.from_hugging_face(tmp_path / "m", quiet=True)
    (tmp_path / "m" / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k != "vocab_size"}))
    with pytest.raises(ValueError, match="config.json: the model config lacks 'vocab_size'"):
        LlamaForCausalLM.from_hugging_face(tmp_path / "m", quiet=True)


# --- weights verified (9) ---------------------------------------------------------------------------------------

def test_checksums_are_written_with_their_algorithm(engine_dir, ckpt_dir):
    for path in (engine_dir, ckpt_dir):
        checksums = json.loads((path / "config.json").read_text())["checksums"]
        assert checksums["algorithm"] == ALGORITHM and "rank0.safetensors" in checksums["files"]
        assert "tokenizer.json" in checksums["files"]


def test_flipped_bytes_in_an_engine_are_caught_and_can_be_skipped(engine_dir, tmp_path, capsys):
    shutil.copytree(engine_dir, tmp_path / "e")
    _flip_byte(tmp_path / "e" / "rank0.safetensors")
    with pytest.raises(ValueError, match="rank0.safetensors: corrupt engine file"):
        Engine.from_dir(tmp_path / "e")
    assert Engine.from_dir(tmp_path / "e", verify=False)
    LLM(tmp_path / "e", device="cpu", quiet=True, skip_checksum=True).shutdown()
    assert main(["run", "--engine_dir", str(tmp_path / "e"), "--max_new_tokens", "1", "hi"]) == 2
    assert "corrupt engine file" in capsys.readouterr().err
    assert main(["run", "--engine_dir", str(tmp_path / "e"), "--skip_checksum", "--max_new_tokens", "1", "hi"]) == 0


def test_flipped_bytes_in_a_checkpoint_are_caught_and_can_be_skipped(ckpt_dir, tmp_path, capsys):
    shutil.copytree(ckpt_dir, tmp_path / "c")
    _flip_byte(tmp_path / "c" / "rank0.safetensors")
    with pytest.raises(ValueError, match="rank0.safetensors: corrupt checkpoint file"):
        LlamaForCausalLM.from_checkpoint(tmp_path / "c")
    args = ["build", "--checkpoint_dir", str(tmp_path / "c"), "--output_dir", str(tmp_path / "e"),
            "--max_batch_size", "2", "--max_input_len", "16", "--max_seq_len", "32"]
    assert main(args) == 2 and "corrupt checkpoint file" in capsys.readouterr().err
    assert main(args + ["--skip_checksum"]) == 0


def test_outputs_written_before_checksums_load_with_a_notice(engine_dir, ckpt_dir, tmp_path, capsys):
    for path, load in ((engine_dir, Engine.from_dir), (ckpt_dir, LlamaForCausalLM.from_checkpoint)):
        shutil.copytree(path, tmp_path / path.name)
        config = json.loads((tmp_path / path.name / "config.json").read_text())
        del config["checksums"]
        (tmp_path / path.name / "config.json").write_text(json.dumps(config))
        assert load(tmp_path / path.name)
        assert "written without checksums" in capsys.readouterr().err


def test_tensors_of_the_wrong_dtype_or_shape_are_named(engine_dir, tmp_path):
    half = _forge_engine(engine_dir, tmp_path / "half", weights=lambda w: {k: v.half() for k, v in w.items()})
    with pytest.raises(ValueError, match="tensor 'embed_tokens.weight' is float16, expected float32"):
        Engine.from_dir(half)
    cut = _forge_engine(engine_dir, tmp_path / "cut", weights=lambda w: {**w, "norm.weight": w["norm.weight"][:8]})
    with pytest.raises(ValueError, match=r"tensor 'norm.weight' has shape \(8,\), expected \(64,\)"):
        Engine.from_dir(cut)


@pytest.mark.parametrize("damage, message", [
    ("truncate tokenizer.json", "tokenizer.json is corrupt or truncated"),
    ("remove tokenizer.json", "tokenizer.json is missing"),
    ("truncate generation_config.json", "generation_config.json is corrupt or truncated"),
])
def test_damaged_tokenizer_files_are_named(engine_dir, tmp_path, damage, message):
    action, name = damage.split()
    shutil.copytree(engine_dir, tmp_path / "e")
    path = tmp_path / "e" / name
    if action == "remove":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:40])
    with pytest.raises((ValueError, FileNotFoundError), match=f"{name}.*(missing|corrupt)"):
        LLM(tmp_path / "e", device="cpu", quiet=True)              # the checksums catch it
    with pytest.raises(ValueError, match=message):
        LLM(tmp_path / "e", device="cpu", quiet=True, skip_checksum=True)   # and so does reading it


def test_nan_weights_are_named_at_conversion(hf_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dir, tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="tensor 'model.layers.1.mlp.up_proj.weight' holds NaN or Inf"):
        LlamaForCausalLM.from_hugging_face(tmp_path / "m", quiet=True)


def test_float32_values_beyond_float16_are_named_when_cast(hf_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dir, tmp_path / "m")
    tensors = load_file(tmp_path / "m" / "model.safetensors")
    tensors["model.norm.weight"][0] = 1e6
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="tensor 'model.norm.weight' holds NaN or Inf"):
        LlamaForCausalLM.from_hugging_face(tmp_path / "m", "float16", quiet=True)


def test_nan_in_a_gguf_is_named(hf_dir, tmp_path):
    import transformers as tf

    from test_gguf import write_gguf

    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir)
    with torch.no_grad():
        model.model.norm.weight[2] = float("inf")
    write_gguf(model, tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="tensor 'output_norm.weight' holds NaN or Inf"):
        LlamaForCausalLM.from_hugging_face(tmp_path / "m.gguf", quiet=True)


def test_legacy_pytorch_bin_files_load(hf_dir, tmp_path):
    from safetensors.torch import load_file

    (tmp_path / "m").mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_dir / name, tmp_path / "m" / name)
    tensors = load_file(hf_dir / "model.safetensors")
    torch.save(tensors, tmp_path / "m" / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    loaded = LlamaForCausalLM.from_hugging_face(tmp_path / "m", quiet=True)
    reference = LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True)
    assert all(torch.equal(loaded.weights[k], reference.weights[k]) for k in reference.weights)
    torch.save([1, 2, 3], tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="not a state dict .* but a list"):
        LlamaForCausalLM.from_hugging_face(tmp_path / "m", quiet=True)


class _Payload:
    """Unpickling this runs code (touches a file): what a hostile .bin carries."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def test_pickled_code_in_a_bin_file_is_never_run(hf_dir, tmp_path):
    (tmp_path / "m").mkdir()
    shutil.copy(hf_dir / "config.json", tmp_path / "m" / "config.json")
    torch.save({"model.norm.weight": _Payload(tmp_path / "ran")}, tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin: corrupt or truncated PyTorch weights file, or one "
                                         "holding more than tensors"):
        LlamaForCausalLM.from_hugging_face(tmp_path / "m", quiet=True)
    assert not (tmp_path / "ran").exists()
