"""Speculative decoding (issue 30, the CPU path): with n-gram lookup and with a draft model, greedy tokens equal
decoding without drafts — on SmolLM2's real weights and on tiny Llama/Mixtral models, alone and in batches that mix
requests that speculate with requests that do not, with chunked context, block reuse and preemption. The rejection
sampling keeps the model's distribution (chi-square, a draft distribution unlike the model's); the KV blocks of
rejected drafts go back to the pool; stop strings, logprobs, streaming and n work as without drafts."""
from __future__ import annotations

import pytest
import torch

from conftest import save_tiny_model
from kiln import LLM, BuildConfig, SamplingConfig, SpeculativeConfig
from kiln.config import KvCacheConfig, PluginConfig, SchedulerPolicy
from kiln.runtime import sampler
from kiln.runtime.kv_cache import KVCacheManager
from kiln.runtime.request import Request
from kiln.runtime.scheduler import SampledToken, Scheduler
from kiln.runtime.speculative import lookup

BUILD = dict(max_batch_size=8, max_input_len=96, max_seq_len=160)
NGRAM = SpeculativeConfig(max_draft_len=4)
# prompts that repeat themselves (lookup finds matches) and one that does not
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], list(range(40, 90)), [72, 101, 108, 108, 111] * 6,
           list(range(100, 109))]


def _llm(model, speculative=None, build=None, **kwargs) -> LLM:
    return LLM(model, build_config=BuildConfig(**(build or BUILD)), quiet=True, device="cpu",
               speculative_config=speculative, **kwargs)


def _tokens(llm, prompts, sampling) -> list[list[int]]:
    sampling = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    return [out.token_ids for out in llm.generate(prompts, sampling)]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A tiny Llama of other weights than the target's (seed 1): a draft model that is often wrong."""
    path = tmp_path_factory.mktemp("draft") / "llama"
    save_tiny_model("llama", path, seed=1)
    return path


def test_lookup_proposes_what_followed_the_latest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert lookup(tokens, range(3, 0, -1), 4) == [7, 5, 1, 2]      # the latest earlier "1 2 3"
    assert lookup(tokens, range(3, 0, -1), 1) == [7]
    assert lookup([4, 5, 6], range(2, 0, -1), 3) == []
    assert lookup([4, 5, 4], range(2, 0, -1), 3) == [5, 4]           # the 1-gram "4", when "5 4" has no match


@pytest.mark.parametrize("model", ["llama", "mixtral"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_tokens_equal_decoding_without_drafts(tiny_models, draft_dir, model, method):
    hf_dir = tiny_models[model][0]
    greedy = SamplingConfig(max_new_tokens=40, end_id=-1)
    with _llm(hf_dir) as llm:
        plain = _tokens(llm, PROMPTS, greedy)
    config = NGRAM if method == "ngram" else SpeculativeConfig(method="draft_model", max_draft_len=3,
                                                               speculative_model=str(draft_dir))
    if model == "mixtral" and method == "draft_model":
        config = SpeculativeConfig(method="draft_model", max_draft_len=3, speculative_model=str(hf_dir))
    with _llm(hf_dir, config) as llm:
        assert _tokens(llm, PROMPTS, greedy) == plain
        assert [_tokens(llm, [p], greedy)[0] for p in PROMPTS] == plain          # each alone
        stats = llm.stats()
        assert stats["draft_tokens"] > 0 and stats["kv_blocks_used"] == 0
        if config.speculative_model == str(hf_dir):                               # the model drafts for itself
            assert stats["draft_acceptance_rate"] == 1.0


@pytest.mark.slow
def test_smollm2_copies_a_text_with_drafts_and_the_same_tokens(smollm2_model, tmp_path):
    from kiln.utils.default_model import default_model_path

    build = dict(max_batch_size=4, max_input_len=256, max_seq_len=320)
    text = ("Kiln turns pretrained language models into fast inference engines for NVIDIA GPUs, with a CPU path so "
            "that everything also runs on a laptop.")
    with _llm(smollm2_model, build=build) as llm:
        prompt = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Repeat this text exactly:\n\n" + text}], tokenize=False,
            add_generation_prompt=True)
        greedy = SamplingConfig(max_new_tokens=40)
        plain = llm.generate(prompt, greedy)
    eagle = write_eagle_head(tmp_path / "eagle", seed=0, hidden=576, shape=(576, 9, 3, 1536))
    for config in (NGRAM, SpeculativeConfig(method="draft_model", max_draft_len=3,
                                            speculative_model=str(default_model_path())),
                   SpeculativeConfig(method="eagle", max_draft_len=3, speculative_model=str(eagle))):
        with _llm(smollm2_model, config, build=build) as llm:
            out = llm.generate(prompt, greedy)
            assert out.token_ids == plain.token_ids and out.text == plain.text
            assert out.metrics.num_draft_tokens > 0
            if config.method != "eagle":                            # (a random head's drafts are rarely right)
                assert out.metrics.mean_accepted_length > 1.5, out.metrics


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
def test_speculating_and_plain_requests_share_steps_with_chunks_reuse_and_preemption(tiny_models, draft_dir,
                                                                                      tmp_path, method):
    """Greedy requests speculate while requests with penalties and n = 2 sampling run beside them without
    drafts; prompts are chunked, share cached prefixes, and the pool is small enough that MAX_UTILIZATION
    preempts."""
    hf_dir = tiny_models["llama"][0]
    prompts = PROMPTS + [PROMPTS[1][:40] + [7, 7], PROMPTS[2] + [3]]
    configs = [SamplingConfig(max_new_tokens=30, end_id=-1)] * 4 + [
        SamplingConfig(max_new_tokens=30, end_id=-1, repetition_penalty=1.3),
        SamplingConfig(max_new_tokens=30, end_id=-1, n=2, temperature=0.8, random_seed=3)]
    options = dict(enable_chunked_context=True, scheduling_policy=SchedulerPolicy.MAX_UTILIZATION,
                   kv_cache_config=KvCacheConfig(max_tokens=8 * 32, enable_block_reuse=True),
                   build=dict(BUILD, max_num_tokens=40, plugin_config=PluginConfig(tokens_per_block=8)))
    build = options.pop("build")
    with LLM(hf_dir, build_config=BuildConfig(**build), quiet=True, device="cpu", **options) as llm:
        plain = [[o.token_ids for o in out.outputs] for out in llm.generate(prompts, configs)]
    config = {"ngram": NGRAM,
              "draft_model": SpeculativeConfig(method="draft_model", max_draft_len=3, speculative_model=str(draft_dir)),
              "eagle": SpeculativeConfig(method="eagle", max_draft_len=3,
                                         speculative_model=str(write_eagle_head(tmp_path / "head", seed=5)))}[method]
    with LLM(hf_dir, build_config=BuildConfig(**build), quiet=True, device="cpu", speculative_config=config,
             **options) as llm:
        outs = llm.generate(prompts, configs)
        # greedy requests give the same tokens; sampled ones draw from logits whose last bits depend on the batch
        assert [[o.token_ids for o in out.outputs] for out in outs[:5]] == plain[:5]
        assert [len(o.token_ids) for o in outs[5].outputs] == [30, 30]
        stats = llm.stats()
        assert stats["preemptions"] > 0 and stats["draft_tokens"] > 0 and stats["prefix_cache_hit_tokens"] > 0
        assert outs[4].metrics.num_draft_tokens == outs[5].metrics.num_draft_tokens == 0   # penalties, n = 2
        assert stats["kv_blocks_used"] == 0


def test_stop_strings_logprobs_and_streaming(tiny_models):
    hf_dir = tiny_models["llama"][0]
    prompt = PROMPTS[3]
    with _llm(hf_dir) as llm:
        full = llm.generate(prompt, SamplingConfig(max_new_tokens=30, end_id=-1))
        stop = full.text[17:19]                                        # a string that ends a few tokens later
        assert len(stop) == 2
        cases = [SamplingConfig(max_new_tokens=30, end_id=-1, stop=[stop]),
                 SamplingConfig(max_new_tokens=30, end_id=-1, logprobs=2)]
        plain = llm.generate([prompt] * 2, cases)
    with _llm(hf_dir, NGRAM) as llm:
        spec = llm.generate([prompt] * 2, cases)
        assert spec[0].text == plain[0].text and spec[0].token_ids == plain[0].token_ids
        assert spec[0].finish_reason == "stop" and len(spec[0].token_ids) < 30
        assert spec[1].token_ids == plain[1].token_ids and spec[1].metrics.num_accepted_draft_tokens > 0
        for a, b in zip(spec[1].logprobs, plain[1].logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.top.keys() == b.top.keys()
        deltas = list(llm.generate_async(prompt, SamplingConfig(max_new_tokens=30, end_id=-1), streaming=True))
        assert [t for d in deltas for t in d.token_ids_diff] == full.token_ids
        assert max(len(d.token_ids_diff) for d in deltas) > 1                 # several tokens in one delta
        assert "".join(d.text_diff for d in deltas) == full.text


def test_abort_during_speculation_frees_everything(tiny_models):
    with _llm(tiny_models["llama"][0], NGRAM) as llm:
        result = llm.generate_async(PROMPTS[0], SamplingConfig(max_new_tokens=60, end_id=-1), streaming=True)
        for out in result:
            if len(out.token_ids) >= 5:
                result.abort()
        assert result.result().finish_reason == "abort"
        assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["running_requests"] == 0


def test_rejected_drafts_give_back_their_blocks():
    """A sequence's drafts reach into two new blocks; one draft is accepted: the block that held only rejected
    drafts returns to the pool, and the next token's slot stays."""
    kv = KVCacheManager(8, 4)
    scheduler = Scheduler(kv, 4, 64)
    request = Request(1, [1, 2, 3], SamplingConfig(max_new_tokens=20, end_id=-1))
    scheduler.add_request(request)
    scheduler.update(scheduler.schedule(), _tokens_out(request, [9]))              # prompt computed, token 9
    seq = request.seqs[0]
    seq.draft_ids = [4, 5, 6, 7, 8]                                                  # positions 4..8: blocks 1, 2
    out = scheduler.schedule()
    assert out.scheduled[0][2] == 6 and len(seq.block_ids) == 3 and kv.num_free_blocks == 5
    result = _tokens_out(request, [])
    result.speculated[request.request_id] = [SampledToken(0, 4), SampledToken(0, 11)]   # 4 accepted, then 11
    scheduler.update(out, result)
    assert seq.token_ids == [1, 2, 3, 9, 4, 11] and seq.num_computed_tokens == 5 and not seq.draft_ids
    assert len(seq.block_ids) == 2 and kv.num_free_blocks == 6
    assert request.num_draft_tokens == 5 and request.num_accepted_draft_tokens == 1


def _tokens_out(request, tokens):
    from kiln.runtime.scheduler import ModelStepOutput

    out = ModelStepOutput()
    if tokens:
        out.tokens[request.request_id] = [SampledToken(0, t) for t in tokens]
    return out


@pytest.mark.parametrize("drafter", ["one-hot", "distribution"])
def test_rejection_sampling_keeps_the_models_distribution(drafter):
    """The first token emitted after a draft drawn from q (deliberately unlike the model's p) follows p: a
    chi-square test over 6,000 draws (p-value > 0.001), and drafts p favours are accepted more often."""
    g = torch.Generator().manual_seed(0)
    vocab = 12
    logits = torch.randn(2, vocab, generator=g) * 1.5               # the model's rows: after the token, after d
    q = torch.softmax(torch.randn(vocab, generator=g) * 2, -1)        # the drafter's distribution
    p = torch.softmax(logits[0], -1)
    request = Request(1, [1], SamplingConfig(max_new_tokens=8, temperature=1.0, end_id=-1))
    seq = request.seqs[0]
    counts, accepted = torch.zeros(vocab), 0
    for _ in range(6000):
        draft = int(torch.multinomial(q, 1, generator=g)) if drafter == "distribution" else 3
        seq.draft_ids, seq.draft_probs = [draft], (q[None] if drafter == "distribution" else None)
        emitted = sampler.verify_drafts(logits, request, seq, g, normalize_log_probs=False)
        counts[emitted[0][0]] += 1
        accepted += len(emitted) == 2
    expected = p * counts.sum()
    keep = expected >= 5                                              # rare tokens pooled into one bin
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]]) if (~keep).any() else counts
    wanted = torch.cat([expected[keep], expected[~keep].sum()[None]]) if (~keep).any() else expected
    statistic = float(((observed - wanted) ** 2 / wanted).sum())
    pvalue = float(torch.special.gammaincc(torch.tensor((len(observed) - 1) / 2), torch.tensor(statistic / 2)))
    assert pvalue > 1e-3, (statistic, observed, wanted)
    rate = accepted / 6000
    overlap = float(torch.minimum(p, q).sum()) if drafter == "distribution" else float(p[3])
    assert rate == pytest.approx(overlap, abs=0.03)                   # P(accept) = Σ min(p, q)


def test_speculative_options_are_checked(tiny_models, tmp_path):
    with pytest.raises(ValueError, match="choose one of ngram, draft_model, eagle"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="speculative_model is the draft model"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="min_matching_ngram_size=3 exceeds"):
        SpeculativeConfig(min_matching_ngram_size=3, max_matching_ngram_size=2)
    hf_dir = tiny_models["llama"][0]
    with _llm(hf_dir) as llm:
        llm.save(tmp_path / "engine")                                 # built with max_draft_len 0
    with pytest.raises(ValueError, match="built with max_draft_len=0"):
        LLM(str(tmp_path / "engine"), device="cpu", quiet=True, speculative_config=NGRAM)
    with pytest.raises(ValueError, match="vocabulary has 49152 tokens"):
        from kiln.utils.default_model import default_model_path

        _llm(hf_dir, SpeculativeConfig(method="draft_model", speculative_model=str(default_model_path())))


def test_kiln_run_speculates_and_prints_the_same_text(tiny_models, capsys):
    from kiln.cli.main import main

    base = ["run", "--model_dir", str(tiny_models["llama"][0]), "--max_new_tokens", "24", "--no_chat_template",
            "--device", "cpu", "ghghghghghghgh"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main(base[:1] + ["--speculative_method", "ngram", "--max_draft_len", "3"] + base[1:]) == 0
    assert capsys.readouterr().out == plain
    assert main(base[:1] + ["--speculative_model", "x"] + base[1:]) == 2
    assert "--speculative_model needs --speculative_method draft_model or eagle" in capsys.readouterr().err


def write_eagle_head(path, seed: int, safetensors: bool = True, drop: str | None = None, hidden: int = 64,
                     shape: tuple[int, int, int, int] = (64, 4, 2, 128)):
    """A random EAGLE head in the public layout for a model of shape (hidden, heads, KV heads, MLP): the tiny
    Llama's by default; `hidden` widens fc's input (a head of another model)."""
    import json

    from safetensors.torch import save_file

    h, heads, kv, mlp = shape
    d = h // heads
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc.weight": (h, 2 * hidden), "fc.bias": (h,), "layers.0.self_attn.q_proj.weight": (h, h),
              "layers.0.self_attn.k_proj.weight": (kv * d, h), "layers.0.self_attn.v_proj.weight": (kv * d, h),
              "layers.0.self_attn.o_proj.weight": (h, h), "layers.0.mlp.gate_proj.weight": (mlp, h),
              "layers.0.mlp.up_proj.weight": (mlp, h), "layers.0.mlp.down_proj.weight": (h, mlp),
              "layers.0.post_attention_layernorm.weight": (h,), "layers.0.input_layernorm.weight": (h,)}
    tensors = {name: torch.randn(s, generator=g) * 0.1 for name, s in shapes.items() if name != drop}
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": h,
                                                  "num_attention_heads": heads, "num_key_value_heads": kv,
                                                  "intermediate_size": mlp, "num_hidden_layers": 1,
                                                  "rms_norm_eps": 1e-5}))
    if safetensors:
        save_file(tensors, str(path / "model.safetensors"))
    else:
        torch.save(tensors, path / "pytorch_model.bin")
    return path


@pytest.mark.parametrize("model", ["llama", "mixtral"])
def test_eagle_heads_keep_the_greedy_tokens(tiny_models, tmp_path, model):
    hf_dir = tiny_models[model][0]
    greedy = SamplingConfig(max_new_tokens=40, end_id=-1)
    with _llm(hf_dir) as llm:
        plain = _tokens(llm, PROMPTS, greedy)
    for i, safetensors in enumerate((True, False)):
        head = write_eagle_head(tmp_path / f"head{i}", seed=i, safetensors=safetensors)
        config = SpeculativeConfig(method="eagle", max_draft_len=3, speculative_model=str(head))
        with _llm(hf_dir, config, enable_chunked_context=True,
                  kv_cache_config=KvCacheConfig(enable_block_reuse=True)) as llm:
            assert _tokens(llm, PROMPTS, greedy) == plain
            assert [_tokens(llm, [p], greedy)[0] for p in PROMPTS] == plain      # alone, prefixes reused
            sampled = llm.generate(PROMPTS[0], SamplingConfig(max_new_tokens=20, temperature=0.9, random_seed=1))
            assert len(sampled.token_ids) == 20 and sampled.metrics.num_draft_tokens > 0
            stats = llm.stats()
            assert stats["draft_tokens"] > 0 and stats["kv_blocks_used"] == 0


def test_eagle_head_cache_gives_what_one_pass_gives(tiny_models, tmp_path):
    """The head over six positions at once equals the head over two, then four after its cache."""
    from kiln.models import LlamaForCausalLM
    from kiln.models.eagle import EagleHead

    model = LlamaForCausalLM.from_hugging_face(tiny_models["llama"][0], quiet=True)
    head = EagleHead(write_eagle_head(tmp_path / "head", seed=3), model.config, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    embeds, features = torch.randn(6, 64, generator=g), torch.randn(6, 64, generator=g)
    positions = torch.arange(3, 9)
    whole, _ = head.forward(embeds, features, positions, None)
    first, cache = head.forward(embeds[:2], features[:2], positions[:2], None)
    rest, _ = head.forward(embeds[2:], features[2:], positions[2:], cache)
    assert torch.allclose(torch.cat([first, rest]), whole, atol=1e-5)
    apart = positions.clone()
    apart[-1] += 10                                                   # rope: relative positions matter
    assert not torch.allclose(head.forward(embeds, features, apart, None)[0][-1], whole[-1], atol=1e-3)


def test_bad_eagle_heads_are_named(tiny_models, tmp_path):
    hf_dir = tiny_models["llama"][0]
    for name, kwargs, match in (("gone", dict(drop="fc.weight"), "tensor fc.weight is missing"),
                                ("wide", dict(hidden=96), r"fc.weight has shape \(64, 192\)")):
        head = write_eagle_head(tmp_path / name, seed=0, **kwargs)
        with pytest.raises(ValueError, match=match):
            _llm(hf_dir, SpeculativeConfig(method="eagle", speculative_model=str(head)))
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        _llm(hf_dir, SpeculativeConfig(method="eagle", speculative_model=str(tmp_path)))
    head = write_eagle_head(tmp_path / "ok", seed=0)
    with pytest.raises(ValueError, match="EAGLE drafting with enable_trt_overlap is not supported yet"):
        _llm(hf_dir, SpeculativeConfig(method="eagle", speculative_model=str(head)), enable_trt_overlap=True)
