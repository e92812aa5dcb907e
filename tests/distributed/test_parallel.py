"""Tensor and pipeline parallelism on the CPU (gloo, one worker process per extra rank): every layout gives the
greedy tokens of TP=1 and logits within 1e-5, through convert → build → LLM; a dead worker is a clear error."""
from __future__ import annotations

import time

import pytest
import torch

from conftest import save_tiny_model, tiny_hf_configs
from kiln import LLM, BuildConfig, SamplingConfig
from kiln.builder.auto_parallel import choose_parallelism
from kiln.cli.main import main
from kiln.config import Mapping, ParallelConfig
from kiln.convert import convert
from kiln.models import LlamaForCausalLM

pytestmark = pytest.mark.slow
BUILD = ["--max_batch_size", "4", "--max_input_len", "64", "--max_seq_len", "128", "--gather_context_logits"]
PROMPTS = [list(range(5, 45)), list(range(100, 109))]


def _outputs(llm: LLM):
    return llm.generate(PROMPTS, SamplingConfig(max_new_tokens=8, end_id=-1))


def _same(outputs, reference):
    for out, ref in zip(outputs, reference):
        assert out.token_ids == ref.token_ids
        assert ((out.context_logits - ref.context_logits).norm() / ref.context_logits.norm()).item() < 1e-5


def _reference(hf_dir):
    with LLM(hf_dir, build_config=BuildConfig(max_batch_size=4, max_input_len=64, max_seq_len=128,
                                              gather_context_logits=True), quiet=True) as llm:
        return _outputs(llm)


def _cli_engine(hf_dir, tmp_path, *convert_flags) -> str:
    assert main(["convert", "--model_dir", str(hf_dir), "--output_dir", str(tmp_path / "ckpt"), *convert_flags]) == 0
    assert main(["build", "--checkpoint_dir", str(tmp_path / "ckpt"), "--output_dir", str(tmp_path / "engine"),
                 *BUILD]) == 0
    return str(tmp_path / "engine")


@pytest.mark.parametrize("name, flags", [
    ("llama", ["--tp_size", "2", "--use_parallel_embedding", "--workers", "2"]),
    ("llama", ["--pp_size", "2"]),
    ("llama", ["--tp_size", "2", "--pp_size", "2"]),
    ("qwen2", ["--tp_size", "2", "--use_parallel_embedding", "--embedding_sharding_dim", "1"]),
    ("mixtral", ["--tp_size", "2", "--moe_tp_mode", "0"]),
    ("mixtral", ["--tp_size", "2", "--pp_size", "2", "--moe_tp_mode", "1"]),
])
def test_parallel_layouts_match_tp1(tiny_models, tmp_path, name, flags):
    hf_dir, _ = tiny_models[name]
    engine_dir = _cli_engine(hf_dir, tmp_path, *flags)
    with LLM(engine_dir, quiet=True) as llm:
        assert llm.engine.pretrained_config.mapping.world_size == llm.core.runner.parallel.mapping.world_size > 1
        _same(_outputs(llm), _reference(hf_dir))


def test_fewer_kv_heads_than_tp_and_an_odd_vocabulary(tmp_path):
    """One KV head replicated on both ranks; 321 vocabulary rows padded to 322 for the split LM head."""
    import transformers

    config = tiny_hf_configs()["mistral"]
    config.vocab_size = 321
    assert config.num_key_value_heads == 1
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    model = LlamaForCausalLM.from_hugging_face(tmp_path / "hf", quiet=True)
    shard = model.shard(Mapping(2, 1, 2, 1))
    assert shard.weights["layers.0.attn.k_proj.weight"].shape[0] == model.config.head_dim
    assert torch.equal(shard.weights["layers.0.attn.k_proj.weight"], model.weights["layers.0.attn.k_proj.weight"])
    assert shard.weights["lm_head.weight"].shape[0] == 161
    build = BuildConfig(max_batch_size=4, max_input_len=64, max_seq_len=128, gather_context_logits=True)
    with LLM(model, build_config=build, quiet=True) as llm:
        reference = _outputs(llm)
    with LLM(model, build_config=build, quiet=True, parallel_config=ParallelConfig(tp_size=2)) as llm:
        _same(_outputs(llm), reference)


def test_a_dead_worker_is_a_clear_error(tiny_models):
    hf_dir, _ = tiny_models["llama"]
    llm = LLM(hf_dir, build_config=BuildConfig(max_batch_size=2, max_input_len=32, max_seq_len=512),
              parallel_config=ParallelConfig(tp_size=2, timeout_s=30), quiet=True)
    try:
        result = llm.generate_async(list(range(5, 20)), SamplingConfig(max_new_tokens=480, end_id=-1))
        time.sleep(1.0)
        llm._workers.processes[0].kill()
        start = time.time()
        with pytest.raises(RuntimeError, match="worker rank 1"):
            result.result(timeout=90)
        assert time.time() - start < 90
    finally:
        llm.shutdown()


def test_auto_parallel_explains_its_choice():
    from kiln.benchmark import shape_config

    config = shape_config("llama-3.1-8b", "bfloat16")
    tp, pp, why = choose_parallelism(config, 8)
    assert (tp, pp) == (8, 1) and "tp=8, pp=1" in why
    tiny = shape_config("smollm2-135m", "float32")                     # 9 query and 3 KV heads
    tp, pp, why = choose_parallelism(tiny, 6)
    assert (tp, pp) == (3, 2) and "num_attention_heads=9 is not divisible by tp_size=6" in why
    with pytest.raises(ValueError, match="exceed the 1.0 GiB limit"):
        choose_parallelism(config, 2, max_memory_bytes=2**30)


def test_sharded_checkpoint_round_trip_and_errors(tiny_models, tmp_path):
    hf_dir, _ = tiny_models["llama"]
    assert main(["convert", "--model_dir", str(hf_dir), "--output_dir", str(tmp_path / "c"), "--tp_size", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "c").glob("rank*.safetensors")) == ["rank0.safetensors", "rank1.safetensors"]
    rank1 = LlamaForCausalLM.from_checkpoint(tmp_path / "c", rank=1)
    assert rank1.config.mapping.rank == 1 and rank1.config.mapping.tp_size == 2
    with pytest.raises(ValueError, match="ranks 0..1; rank 2 asked"):
        LlamaForCausalLM.from_checkpoint(tmp_path / "c", rank=2)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tp_size=3"):
        LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True).shard(Mapping(3, 0, 3, 1))
    assert main(["convert", "--model_dir", str(hf_dir), "--output_dir", str(tmp_path / "x"),
                 "--use_embedding_sharing"]) == 2


LAUNCHED_SCRIPT = """
import json, sys
from kiln import LLM, SamplingConfig
llm = LLM(sys.argv[1], quiet=True)
outs = llm.generate({prompts}, SamplingConfig(max_new_tokens=8, end_id=-1))
print("TOKENS", json.dumps([o.token_ids for o in outs]), flush=True)
llm.shutdown()
"""


def _launched_tokens(stdout: str):
    import json

    lines = [line for line in stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1, stdout                       # only rank 0 returns from LLM(...) and prints
    return json.loads(lines[0][len("TOKENS "):])


def test_torchrun_runs_the_same_engine(tiny_models, tmp_path):
    """Every rank runs the user's script under torchrun; ranks > 0 serve inside LLM(...) and exit with rank 0."""
    import subprocess
    import sys

    hf_dir, _ = tiny_models["llama"]
    engine_dir = _cli_engine(hf_dir, tmp_path, "--tp_size", "2")
    script = tmp_path / "generate.py"
    script.write_text(LAUNCHED_SCRIPT.format(prompts=PROMPTS))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), engine_dir],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _launched_tokens(done.stdout) == [o.token_ids for o in _reference(hf_dir)]


def test_worker_rank_as_its_own_program(tiny_models, tmp_path):
    """Rank 0 runs a program over the engine; rank 1 runs `python -m kiln.runtime.workers ENGINE` (as on another
    host)."""
    import os
    import subprocess
    import sys

    from kiln.distributed import free_port

    hf_dir, _ = tiny_models["llama"]
    engine_dir = _cli_engine(hf_dir, tmp_path, "--pp_size", "2")
    script = tmp_path / "generate.py"
    script.write_text(LAUNCHED_SCRIPT.format(prompts=PROMPTS))
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    worker = subprocess.Popen([sys.executable, "-m", "kiln.runtime.workers", engine_dir], env=dict(env, RANK="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    main_rank = subprocess.run([sys.executable, str(script), engine_dir], env=dict(env, RANK="0"),
                               capture_output=True, text=True, timeout=300)
    _, worker_err = worker.communicate(timeout=60)
    assert main_rank.returncode == 0 and worker.returncode == 0, main_rank.stderr[-2000:] + worker_err[-2000:]
    assert _launched_tokens(main_rank.stdout) == [o.token_ids for o in _reference(hf_dir)]


def test_launched_rank_needs_a_matching_engine(tiny_models, tmp_path, monkeypatch):
    hf_dir, _ = tiny_models["llama"]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="needs a built engine directory with 2 ranks"):
        LLM(hf_dir, quiet=True)
    engine_dir = _cli_engine(hf_dir, tmp_path)
    with pytest.raises(ValueError, match="has 1 ranks but 2 processes were started"):
        LLM(engine_dir, quiet=True)


def test_pipeline_micro_batches_split_whole_sequences():
    from kiln.runtime.step import Step, split_step

    starts = [0, 6, 7, 8, 14]
    step = Step([(1, 2)], list(range(14)), list(range(14)), list(range(14)), starts, [6, 3, 3, 9],
                [[0], [1], [2], [3]], 6, 9, [5, 6, 7, 13, 0, 1])
    parts = split_step(step, 2)
    assert [p.query_start_loc for p, _ in parts] == [[0, 6, 7], [0, 1, 7]]
    assert [p.block_copies for p, _ in parts] == [[(1, 2)], []]
    assert [p.seq_lens for p, _ in parts] == [[6, 3], [3, 9]]
    assert [(p.logit_rows, owned) for p, owned in parts] == [([5, 6, 0, 1], [0, 1, 4, 5]), ([0, 6], [2, 3])]
    assert [p.max_query_len for p, _ in parts] == [6, 6]
    assert len(split_step(step, 8)) == 4 and len(split_step(step, 1)) == 1
    rebuilt = [step.input_ids[0:0]]
    for p, _ in parts:
        rebuilt[0] += p.input_ids
    assert rebuilt[0] == step.input_ids


def test_custom_all_reduce_needs_tensor_parallel_gpus(tiny_models, tmp_path):
    hf_dir, _ = tiny_models["llama"]
    model = LlamaForCausalLM.from_hugging_face(hf_dir, quiet=True)
    build = BuildConfig.from_dict({"max_batch_size": 2, "max_input_len": 32, "max_seq_len": 64,
                                   "plugin_config": {"use_custom_all_reduce": True}})
    with pytest.raises(ValueError, match="use_custom_all_reduce needs tensor parallelism"):
        LLM(model, build_config=build, quiet=True)
    with pytest.raises(ValueError, match="use_custom_all_reduce, which needs CUDA GPUs"):
        LLM(model, build_config=build, quiet=True, parallel_config=ParallelConfig(tp_size=2, timeout_s=20))


def test_build_shards_from_yaml_and_auto_parallel(tiny_models, tmp_path):
    """The seed's YAML with checkpoint tp_size/pp_size, and kiln build --auto_parallel --workers, build every rank."""
    import json

    hf_dir, _ = tiny_models["llama"]
    yaml_file = tmp_path / "build.yaml"
    yaml_file.write_text(f"""
model: {{model_dir: {hf_dir}, output_dir: {tmp_path / 'engine_yaml'}, dtype: float32}}
checkpoint: {{tp_size: 2, pp_size: 1, use_parallel_embedding: true, workers: 2}}
build: {{max_input_len: 64, max_seq_len: 128, max_batch_size: 4, gather_context_logits: true}}
""")
    assert main(["build", "--config", str(yaml_file)]) == 0
    assert main(["build", "--model_dir", str(hf_dir), "--output_dir", str(tmp_path / "engine_auto"), "--auto_parallel",
                 "2", "--workers", "2", *BUILD]) == 0
    reference = _reference(hf_dir)
    for name in ("engine_yaml", "engine_auto"):
        config = json.loads((tmp_path / name / "config.json").read_text())["pretrained_config"]
        assert config["mapping"]["tp_size"] == 2 and (tmp_path / name / "rank1.safetensors").is_file()
        with LLM(str(tmp_path / name), quiet=True) as llm:
            _same(_outputs(llm), reference)
    assert json.loads((tmp_path / "engine_yaml" / "config.json").read_text())["pretrained_config"][
        "use_parallel_embedding"] is True


@pytest.mark.parametrize("name, flags", [
    ("llama", ["--tp_size", "2", "--pp_size", "2", "--use_parallel_embedding"]),
    ("mixtral", ["--tp_size", "2", "--moe_tp_mode", "1", "--pp_size", "2"]),
])
def test_load_by_shard_writes_the_same_ranks(tiny_models, tmp_path, monkeypatch, name, flags):
    """Each rank read on its own, a tensor at a time, gives the files of whole-model sharding; a pipeline stage
    never reads another stage's layers."""
    from safetensors.torch import load_file

    from kiln.checkpoint import hf

    hf_dir, _ = tiny_models[name]
    assert main(["convert", "--model_dir", str(hf_dir), "--output_dir", str(tmp_path / "whole"), *flags]) == 0
    read = []
    original = hf.iter_file_tensors
    monkeypatch.setattr(hf, "iter_file_tensors", lambda path, wanted=None: (
        (read.append(n) or (n, t)) for n, t in original(path, wanted)))
    assert main(["convert", "--model_dir", str(hf_dir), "--output_dir", str(tmp_path / "streamed"),
                 "--load_by_shard", "--workers", "2", *flags]) == 0
    for rank in range(4):
        whole = load_file(tmp_path / "whole" / f"rank{rank}.safetensors")
        streamed = load_file(tmp_path / "streamed" / f"rank{rank}.safetensors")
        assert whole.keys() == streamed.keys() and all(torch.equal(whole[k], streamed[k]) for k in whole)
    layer0 = [n for n in read if ".layers.0." in n]
    assert len(layer0) == 2 * len(set(layer0))                   # read by the 2 ranks of stage 0 only
    assert main(["convert", "--model_dir", str(hf_dir), "--output_dir", str(tmp_path / "q"), "--load_by_shard",
                 "--tp_size", "2", "--use_weight_only"]) == 2


@pytest.mark.parametrize("algo, kv, tolerance", [
    ("W8A16", None, 1e-5), ("W4A16_AWQ", "INT8", 1e-5), ("W4A16", None, 1e-5),
    ("W8A8_SQ_PER_CHANNEL_PER_TOKEN", None, 3e-2), ("FP8", "FP8", 1e-5),
])
def test_quantized_models_shard(tiny_models, algo, kv, tolerance):
    """Sharded quantized weights compute what the unsharded ones do (per-token activation scales are per rank's
    input slice, hence the looser bound there), on the exact reference products (CpuOps' bf16 activations would
    round the two splittings differently)."""
    from kiln.config import PluginConfig, QuantConfig

    hf_dir, _ = tiny_models["llama"]
    model = convert(hf_dir, quant_config=QuantConfig(algo, kv, group_size=32), calib_size=2, quiet=True)
    build = BuildConfig(max_batch_size=4, max_input_len=64, max_seq_len=128, gather_context_logits=True,
                        plugin_config=PluginConfig(cpu_kernels="reference"))
    with LLM(model, build_config=build, quiet=True) as llm:
        reference = _outputs(llm)
    with LLM(model, build_config=build, quiet=True, parallel_config=ParallelConfig(tp_size=2)) as llm:
        outputs = _outputs(llm)
    for out, ref in zip(outputs, reference):
        error = ((out.context_logits - ref.context_logits).norm() / ref.context_logits.norm()).item()
        assert error < tolerance, (algo, error)
        if tolerance < 1e-4:
            assert out.token_ids == ref.token_ids


def test_int4_groups_may_not_straddle_ranks(tiny_models):
    from kiln.config import QuantConfig

    hf_dir, _ = tiny_models["llama"]
    model = convert(hf_dir, quant_config=QuantConfig("W4A16_AWQ", group_size=64), calib_size=2, quiet=True)
    with pytest.raises(ValueError, match=r"attention output inputs per rank \(32\) are not a multiple of 64"):
        model.shard(Mapping(2, 0, 2, 1))


def test_prompt_tables_cross_ranks(tiny_models):
    """A prompt table's rows reach every rank: TP=2 and PP=2 give TP=1's tokens (the rows travel in the Step)."""
    from conftest import VOCAB

    torch.manual_seed(0)
    table = torch.randn(4, 64) * 0.05
    build = BuildConfig(max_input_len=64, max_seq_len=96, max_prompt_embedding_table_size=8)
    prompt, sampling = [5, VOCAB, VOCAB + 3, 7, VOCAB + 1], SamplingConfig(max_new_tokens=8, end_id=-1)
    tokens = []
    for parallel in (None, ParallelConfig(tp_size=2), ParallelConfig(pp_size=2)):
        with LLM(str(tiny_models["llama"][0]), build_config=build, parallel_config=parallel, quiet=True) as llm:
            tokens.append(llm.generate(prompt, sampling, prompt_table=table).token_ids)
    assert tokens[1] == tokens[0] and tokens[2] == tokens[0]
