"""LoRA adapters over the OpenAI HTTP API (issue 29, "Serve"): `kiln serve --lora_modules` answers the official
openai client per `model` with the tokens LLM.generate gives under each adapter (greedy, plain and streamed), lists
the base model and its adapters, answers an unknown model with OpenAI's 404; adapters loaded and unloaded at run
time (only with an API key); adapters stored in the engine served by name; a bad adapter stops the server at
start-up, named, before the port is bound."""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("peft")
pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from conftest import ROOT, save_tiny_model  # noqa: E402
from kiln import LLM, BuildConfig, LoRARequest, SamplingConfig  # noqa: E402
from kiln.config import LoraConfig  # noqa: E402
from kiln.server import ServerConfig, create_app  # noqa: E402
from test_server import KEY, _free_port, metric, post, wait_until_serving  # noqa: E402

BASE = "tiny-llama"                        # the served name of the model directory
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT, MAX_TOKENS = "Hello there", 12
LONG = 480                                 # tokens of a request still running when its adapter is unloaded
MESSAGES = [{"role": "user", "content": "Hi!"}]
needs_cli = pytest.mark.skipif(shutil.which("kiln") is None, reason="package scripts not installed")


def _make_adapter():
    """tests/lora/peft_adapters.py's make_adapter (that directory is not on this one's import path)."""
    spec = importlib.util.spec_from_file_location("peft_adapters", ROOT / "tests" / "lora" / "peft_adapters.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_adapter


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    """The tiny Llama and three adapters of it (sql and chat served from the start, math loaded at run time)."""
    root = tmp_path_factory.mktemp("serve-lora")
    save_tiny_model("llama", root / BASE)
    make_adapter = _make_adapter()
    specs = {"sql": dict(targets=["q_proj", "v_proj"], seed=1), "chat": dict(targets=ALL, seed=2),
             "math": dict(targets=["k_proj", "o_proj", "up_proj"], seed=3, r=4)}
    for name, spec in specs.items():
        make_adapter(root / BASE, root / name, **spec)
    return {"model": str(root / BASE), **{name: str(root / name) for name in specs}}


@pytest.fixture(scope="module")
def llm(paths):
    """The reference: the same model in this process, as `kiln serve` builds it."""
    with LLM(paths["model"], quiet=True) as llm:
        yield llm


@pytest.fixture(scope="module")
def served(paths, tmp_path_factory):
    """`kiln serve` with the adapters sql and chat and an API key; yields its URL."""
    if shutil.which("kiln") is None:
        pytest.skip("package scripts not installed")
    port, log = _free_port(), tmp_path_factory.mktemp("log") / "serve.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(["kiln", "serve", paths["model"], "--port", str(port), "--api-key", KEY,
                                 "--kv_cache_max_tokens", "2048", "--lora_modules", f"sql={paths['sql']}",
                                 f"chat={paths['chat']}"], stderr=stderr, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, url)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert proc.returncode in (0, -signal.SIGTERM), log.read_text()
    assert "adapter='sql'" in log.read_text()             # the request log line names the adapter


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served}/v1", api_key=KEY, max_retries=0, timeout=60)


def expected(llm, paths, adapter: str | None, prompt=PROMPT):
    """LLM.generate's greedy output (with each token's logprob) under `adapter` (None: the base model)."""
    lora = None if adapter is None else LoRARequest(adapter, paths[adapter])
    return llm.generate(prompt, SamplingConfig(max_new_tokens=MAX_TOKENS, temperature=0, logprobs=0),
                        lora_request=lora)


# --- requests pick their adapter by model -------------------------------------------------------------------

def test_each_model_answers_with_the_tokens_of_its_adapter(client, llm, paths):
    outputs = {}
    for model, adapter in ((BASE, None), ("sql", "sql"), ("chat", "chat")):
        want = expected(llm, paths, adapter)
        got = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=0)
        # the text, the number of tokens and each token's logprob: the same tokens (byte-level tokens that are not
        # UTF-8 on their own all show as U+FFFD, so the text alone could hide a different byte)
        assert got.model == model
        assert got.choices[0].text == want.text
        assert got.usage.completion_tokens == len(want.token_ids) == MAX_TOKENS
        assert got.choices[0].logprobs.token_logprobs == pytest.approx([e.logprob for e in want.logprobs],
                                                                       rel=1e-5, abs=1e-6)
        outputs[model] = tuple(want.token_ids)
    assert len(set(outputs.values())) == 3, "the adapters do not change the greedy tokens: a weak test"


def test_models_lists_the_base_model_and_its_adapters(client):
    models = client.models.list().data
    assert [(m.id, m.parent) for m in models] == [(BASE, None), ("sql", BASE), ("chat", BASE)]
    assert client.models.retrieve("chat").parent == BASE


def test_an_unknown_model_gets_openais_404(client, served):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    error = caught.value.response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert error["type"] == "invalid_request_error"
    assert all(repr(name) in error["message"] for name in ("nope", BASE, "sql", "chat"))
    chat = post(served, "/v1/chat/completions", {"model": "nope", "messages": MESSAGES})
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "model_not_found"


def test_streams_under_an_adapter(client, llm, paths):
    want = expected(llm, paths, "chat")
    chunks = list(client.completions.create(model="chat", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert {c.model for c in chunks} == {"chat"}

    prompt = llm.apply_chat_template(MESSAGES)
    want = expected(llm, paths, "sql", prompt)
    plain = client.chat.completions.create(model="sql", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    streamed = client.chat.completions.create(model="sql", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == plain.choices[0].message.content == want.text


def test_requests_are_counted_by_model(client, served):
    client.completions.create(model="sql", prompt=PROMPT, max_tokens=1)
    assert metric(served, "kiln_model_requests_total", '{model="sql"}') >= 1


# --- loading and unloading at run time ----------------------------------------------------------------------

def test_load_and_unload_adapters(client, served, llm, paths):
    load = {"lora_name": "math", "lora_path": paths["math"]}
    assert post(served, "/v1/load_lora_adapter", load, key=None).status_code == 401
    assert post(served, "/v1/load_lora_adapter", load, key="wrong").status_code == 401
    card = post(served, "/v1/load_lora_adapter", load)
    assert card.status_code == 200 and card.json()["id"] == "math" and card.json()["parent"] == BASE
    assert [m.id for m in client.models.list().data] == [BASE, "sql", "chat", "math"]
    got = client.completions.create(model="math", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].text == expected(llm, paths, "math").text

    again = post(served, "/v1/load_lora_adapter", load)
    assert again.status_code == 400 and again.json()["error"]["code"] == "model_exists"
    base = post(served, "/v1/load_lora_adapter", {**load, "lora_name": BASE})
    assert base.status_code == 400 and base.json()["error"]["code"] == "model_exists"

    assert post(served, "/v1/unload_lora_adapter", {"lora_name": "math"}, key=None).status_code == 401
    gone = post(served, "/v1/unload_lora_adapter", {"lora_name": "math"})
    assert gone.status_code == 200 and gone.json() == {"id": "math", "object": "model", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="math", prompt=PROMPT, max_tokens=2)
    unknown = post(served, "/v1/unload_lora_adapter", {"lora_name": "math"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"

    # the name again, for another directory: read afresh, its tokens are the new adapter's
    assert post(served, "/v1/load_lora_adapter", {"lora_name": "math", "lora_path": paths["chat"]}).status_code == 200
    got = client.completions.create(model="math", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].text == expected(llm, paths, "chat").text
    assert post(served, "/v1/unload_lora_adapter", {"lora_name": "math"}).status_code == 200


def test_unloading_lets_admitted_requests_finish_under_the_adapter(client, served, llm, paths):
    assert post(served, "/v1/load_lora_adapter", {"lora_name": "busy", "lora_path": paths["math"]}).status_code == 200
    stream = client.completions.create(model="busy", prompt=PROMPT, max_tokens=LONG, temperature=0, stream=True)
    assert post(served, "/v1/unload_lora_adapter", {"lora_name": "busy"}).status_code == 200
    assert metric(served, "kiln_requests_running") == 1          # the engine is still generating it
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="busy", prompt=PROMPT, max_tokens=2)
    want = llm.generate(PROMPT, SamplingConfig(max_new_tokens=LONG, temperature=0),
                        lora_request=LoRARequest("math", paths["math"]))
    assert "".join(c.choices[0].text for c in stream) == want.text


def test_a_bad_adapter_is_refused_at_load_naming_what_is_wrong(client, served, paths, tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16}')
    cases = [(str(tmp_path / "nowhere"), "no such directory"), (str(tmp_path), "no weights"),
             (paths["model"], "adapter_config.json is missing")]
    for path, reason in cases:
        refused = post(served, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": path})
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["code"] == "invalid_adapter" and error["param"] == "lora_path"
        assert reason in error["message"] and path in error["message"]
    for body in ({"lora_name": "", "lora_path": paths["math"]}, {"lora_name": "x"},
                 {"lora_name": " x", "lora_path": "/"}, {"lora_name": "x", "lora_path": paths["math"], "lora_int_id": 3}):
        assert post(served, "/v1/load_lora_adapter", body).status_code == 400, body
    assert [m.id for m in client.models.list().data] == [BASE, "sql", "chat"]


def test_a_server_without_a_key_loads_no_adapters(llm, paths):
    from fastapi.testclient import TestClient

    with TestClient(create_app(llm, ServerConfig(model_name=BASE))) as http:
        load = {"lora_name": "math", "lora_path": paths["math"]}
        for route, body in (("load", load), ("unload", {"lora_name": "x"})):
            refused = http.post(f"/v1/{route}_lora_adapter", json=body)
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "adapter_loading_disabled"
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [BASE]


# --- adapters stored in the engine; bad adapters at start-up ------------------------------------------------

def test_adapters_stored_in_the_engine_are_served_by_name(paths, llm):
    from fastapi.testclient import TestClient

    build = BuildConfig(lora_config=LoraConfig(lora_dir=[paths["sql"]]))
    with LLM(paths["model"], build_config=build, quiet=True) as stored:
        with TestClient(create_app(stored, ServerConfig(model_name=BASE))) as http:
            assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [BASE, "sql"]
            got = http.post("/v1/completions", json={"model": "sql", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0})
            assert got.json()["choices"][0]["text"] == expected(llm, paths, "sql").text
        with pytest.raises(ValueError, match="'sql' is also the name of an adapter stored in the engine"):
            create_app(stored, ServerConfig(model_name=BASE, lora_modules={"sql": paths["chat"]}))


def test_bad_adapters_in_the_server_config_are_named(llm, tmp_path):
    with pytest.raises(ValueError, match=r"LoRA adapter 'gone' \(.*nowhere\): no such directory"):
        create_app(llm, ServerConfig(model_name=BASE, lora_modules={"gone": str(tmp_path / "nowhere")}))
    with pytest.raises(ValueError, match="is the base model's name"):
        ServerConfig(model_name=BASE, lora_modules={BASE: str(tmp_path)})
    with pytest.raises(ValueError, match="whitespace"):
        ServerConfig(lora_modules={"sql ": str(tmp_path)})


@needs_cli
def test_cli_stops_at_a_bad_adapter_before_binding_the_port(paths, tmp_path):
    """An adapter of another model (the tiny Mistral's one KV head): named, with the tensor and shapes, and the
    process ends with status 2 without ever serving."""
    save_tiny_model("mistral", tmp_path / "mistral")
    _make_adapter()(tmp_path / "mistral", tmp_path / "other", ["k_proj"], seed=4)
    port = _free_port()
    result = subprocess.run(["kiln", "serve", paths["model"], "--port", str(port), "--lora_modules",
                             f"sql={paths['sql']}", f"other={tmp_path / 'other'}"],
                            env={**os.environ, "KILN_API_KEY": KEY}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"LoRA adapter 'other' ({tmp_path / 'other'})" in result.stderr
    assert "k_proj.lora_B.weight has shape" in result.stderr and "trained on another model" in result.stderr
    assert "Uvicorn running" not in result.stderr and "Traceback" not in result.stderr


@needs_cli
@pytest.mark.parametrize("flags, message", [(["sql"], "is not NAME=PATH"), (["a=/x", "a=/y"], "names 'a' twice")])
def test_cli_refuses_malformed_lora_modules(paths, flags, message):
    result = subprocess.run(["kiln", "serve", paths["model"], "--lora_modules", *flags], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr
