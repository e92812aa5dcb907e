"""`kiln serve` (issue 7): the official openai client against a server on 127.0.0.1, streaming equal to plain
answers, concurrency, disconnects and shutdown freeing KV blocks, bad input answered with OpenAI error bodies,
metrics, logging, the CLI, and the chat page in headless Chromium."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from conftest import save_tiny_model  # noqa: E402
from kiln import LLM, BuildConfig, KvCacheConfig, SamplingConfig  # noqa: E402
from kiln.server import ServerConfig, create_app  # noqa: E402
from kiln.server.run import KilnServer  # noqa: E402

KEY = "test-key"
MODEL = "tiny"
MAX_INPUT, MAX_SEQ, BATCH = 256, 512, 16
LONG = MAX_SEQ - 32          # tokens of a generation that runs for seconds on the tiny model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "tiny-llama"
    save_tiny_model("llama", path)
    return path


@pytest.fixture(scope="module")
def llm(tiny_dir):
    build = BuildConfig(max_batch_size=BATCH, max_input_len=MAX_INPUT, max_output_len=MAX_SEQ - 1,
                        max_seq_len=MAX_SEQ)
    with LLM(tiny_dir, build_config=build, kv_cache_config=KvCacheConfig(enable_block_reuse=True), quiet=True) as llm:
        yield llm


@pytest.fixture(scope="module")
def long_prompts(llm) -> list[str]:
    """Prompts whose greedy answer runs the full LONG tokens (no end token): requests that stay in flight."""
    candidates = [f"long prompt {i}" for i in range(28)]
    outputs = llm.generate(candidates, SamplingConfig(max_new_tokens=LONG, temperature=0))
    prompts = [p for p, out in zip(candidates, outputs) if out.finish_reason == "length"]
    assert len(prompts) >= BATCH
    return prompts


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def run_server(llm, shutdown_timeout: float = 5.0, **config):
    """A KilnServer on a free port of 127.0.0.1 in a thread; yields (base url, server)."""
    server = KilnServer(create_app(llm, ServerConfig(**{"model_name": MODEL, **config})), port=_free_port(),
                        shutdown_timeout=shutdown_timeout, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}", server
    finally:
        server.stop()
        thread.join(30)
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def base(llm):
    with run_server(llm, api_key=KEY) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)


def post(base: str, path: str, body, key: str | None = KEY, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    return httpx.post(f"{base}{path}", content=content, headers=headers, **{"timeout": 60, **kwargs})


def metric(base: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{base}/metrics").text
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert match, f"{name}{labels} not in /metrics"
    return float(match.group(1))


def wait_for_idle(base: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while metric(base, "kiln_kv_blocks_used") or metric(base, "kiln_requests_running"):
        assert time.monotonic() < deadline, "KV blocks still allocated"
        time.sleep(0.05)


# --- the openai client ------------------------------------------------------------------------------------

def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


@pytest.mark.parametrize("prompt", ["Hello there", "The capital of France is", [65, 66, 67, 68]])
def test_completion_streamed_equals_plain(client, llm, prompt):
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    expected = llm.generate(prompt, SamplingConfig(max_new_tokens=24, temperature=0))
    assert plain.choices[0].text == expected.text
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert plain.usage.completion_tokens == 24
    assert plain.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_chat_streamed_equals_plain(client, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20,
                                                 temperature=0, stream=True))
    expected = llm.generate(llm.apply_chat_template(messages), SamplingConfig(max_new_tokens=20, temperature=0))
    assert plain.choices[0].message.content == expected.text and plain.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert plain.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_sampling_fields_reach_the_engine(client, llm):
    """temperature, top_p, seed and both penalties mean what SamplingConfig means."""
    fields = dict(temperature=0.8, top_p=0.9, seed=3, presence_penalty=1.0, frequency_penalty=0.5)
    got = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=16, **fields)
    expected = llm.generate("Once upon", SamplingConfig(max_new_tokens=16, temperature=0.8, top_p=0.9, random_seed=3,
                                                        presence_penalty=1.0, frequency_penalty=0.5))
    assert got.choices[0].text == expected.text
    again = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=16, **fields)
    assert again.choices[0].text == got.choices[0].text


def test_n_and_several_prompts(client):
    got = client.completions.create(model=MODEL, prompt=["ab", "cd"], n=3, max_tokens=8, temperature=1.0, seed=7)
    assert [c.index for c in got.choices] == list(range(6))
    assert len({c.text for c in got.choices}) > 1
    assert got.usage.completion_tokens == 6 * 8
    chunks = list(client.completions.create(model=MODEL, prompt=["ab", "cd"], n=3, max_tokens=8, temperature=1.0,
                                            seed=7, stream=True))
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(6)}
    assert texts == {c.index: c.text for c in got.choices}


def test_logprobs(client):
    got = client.completions.create(model=MODEL, prompt="xyz", max_tokens=6, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(len(top) <= 2 and max(top.values()) >= chosen - 1e-5 for top, chosen in
               zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    streamed = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                   max_tokens=5, temperature=0, logprobs=True, stream=True))
    tokens = [t.logprob for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == pytest.approx([t.logprob for t in content])


def test_stop_and_echo(client):
    full = client.completions.create(model=MODEL, prompt="Hello", max_tokens=30, temperature=0).choices[0].text
    stop = next(ch for ch in full[3:] if ch != "\ufffd")
    cut = client.completions.create(model=MODEL, prompt="Hello", max_tokens=30, temperature=0, stop=[stop, "@@@"])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    echoed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=30, temperature=0, echo=True)
    assert echoed.choices[0].text == "Hello" + full
    streamed = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=30, temperature=0, echo=True,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == "Hello" + full


# --- concurrency, disconnects, queue, shutdown -------------------------------------------------------------

def test_32_concurrent_streams(base, llm):
    prompts = [f"Request number {i}:" for i in range(32)]
    expected = [o.text for o in llm.generate(prompts, SamplingConfig(max_new_tokens=24, temperature=0))]

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                  stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    assert asyncio.run(all_of_them()) == expected
    wait_for_idle(base)


def _open_stream(client: httpx.Client, base: str, body: dict):
    """A streaming request whose first event has arrived: (response context, iterator over the next lines)."""
    context = client.stream("POST", f"{base}/v1/completions", json={**body, "stream": True},
                            headers={"Authorization": f"Bearer {KEY}"})
    response = context.__enter__()
    assert response.status_code == 200
    lines = response.iter_lines()       # kept: dropping it would close the response
    assert next(lines).startswith("data: {")
    return context, lines


def test_disconnects_free_kv_blocks(base, llm, long_prompts, caplog):
    body = {"model": MODEL, "max_tokens": LONG, "temperature": 0}
    before = llm.stats()["scheduled_tokens"]
    with caplog.at_level(logging.INFO, logger="kiln.server"):
        streams = []
        for i in range(10):
            client = httpx.Client(timeout=60)
            streams.append((client, *_open_stream(client, base, {**body, "prompt": long_prompts[i]})))
        assert metric(base, "kiln_kv_blocks_used") > 0
        for client, context, _ in streams:
            context.__exit__(None, None, None)
            client.close()
        with pytest.raises(httpx.ReadTimeout):           # a plain request whose client gives up
            post(base, "/v1/completions", {**body, "prompt": long_prompts[10]}, timeout=0.3)
        wait_for_idle(base)
    assert llm.stats()["scheduled_tokens"] - before < 11 * LONG // 2, "the requests ran on after the disconnects"
    lines = [r.getMessage() for r in caplog.records if "/v1/completions" in r.getMessage()]
    assert sum("stream ended early" in line for line in lines) == 10
    assert sum("client disconnected" in line for line in lines) == 1


def test_full_queue_is_refused(llm, long_prompts, caplog):
    with run_server(llm, max_queue=0, log_prompts=True) as (url, _), caplog.at_level(logging.INFO, "kiln.server"):
        body = {"model": MODEL, "max_tokens": 300, "temperature": 0}
        with httpx.Client(timeout=60) as client:
            streams = [_open_stream(client, url, {**body, "prompt": p}) for p in long_prompts[:BATCH]]
            refused = post(url, "/v1/completions", {**body, "prompt": "one too many"}, key=None)
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "queue_full" and f"{BATCH} requests" in refused.json()["error"]["message"]
            assert metric(url, "kiln_server_requests_in_flight") == BATCH
            for context, _ in streams:
                context.__exit__(None, None, None)
        wait_for_idle(url)
        assert post(url, "/v1/completions", {**body, "prompt": "now", "max_tokens": 2}, key=None).status_code == 200
        assert metric(url, "kiln_requests_total", '{route="/v1/completions",status="429"}') == 1
    assert any("prompt='now'" in r.getMessage() for r in caplog.records)


def test_graceful_shutdown(llm, long_prompts, caplog):
    """A request that can finish within the deadline finishes; the others end cleanly at the deadline (a plain
    request with a 503 OpenAI body, a stream with an error event then [DONE]), with no error logged; no KV block
    stays used."""
    before = llm.stats()["scheduled_tokens"]
    long_body = {"model": MODEL, "max_tokens": LONG, "temperature": 0}
    with (run_server(llm, shutdown_timeout=0.5) as (url, server), httpx.Client(timeout=20) as client,
          caplog.at_level(logging.WARNING)):
        long = [_open_stream(client, url, {**long_body, "prompt": p}) for p in long_prompts[:6]]
        plain: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: plain.append(
            post(url, "/v1/completions", {**long_body, "prompt": long_prompts[6]}, key=None)))
        waiter.start()
        while metric(url, "kiln_server_requests_in_flight") < 7:
            time.sleep(0.01)
        short = _open_stream(client, url, {"model": MODEL, "prompt": "short", "max_tokens": 20})
        started = time.monotonic()
        server.stop()
        ends = [_tail(lines) for _, lines in [short, *long]]
        waiter.join(20)
        assert time.monotonic() - started < 5
        for context, _ in [short, *long]:
            context.__exit__(None, None, None)
    assert ends[0][-1] == "data: [DONE]"
    assert json.loads(ends[0][-2].removeprefix("data: "))["choices"][0]["finish_reason"] in ("stop", "length")
    for end in ends[1:]:
        assert end[-1] == "data: [DONE]"
        assert json.loads(end[-2].removeprefix("data: "))["error"]["code"] == "server_shutting_down"
    assert plain[0].status_code == 503 and plain[0].json()["error"]["code"] == "server_shutting_down"
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    deadline = time.monotonic() + 10                    # the engine applies the aborts on its next step
    while (stats := llm.stats())["kv_blocks_used"] or stats["running_requests"]:
        assert time.monotonic() < deadline, f"KV blocks still allocated after the shutdown: {stats}"
        time.sleep(0.05)
    assert llm.healthy()
    assert stats["scheduled_tokens"] - before < 7 * LONG * 0.8, "the long requests were not aborted"


def _tail(lines) -> list[str]:
    """The non-empty lines of a streamed response, read until the server ends it (or cuts it)."""
    seen = []
    with contextlib.suppress(httpx.HTTPError):
        for line in lines:
            if line:
                seen.append(line)
    return seen or [""]


# --- bad input --------------------------------------------------------------------------------------------

GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BAD = [  # (path, body, key, status, code, words in the message)
    ("/v1/completions", b'{"model": "tiny", "prompt": ', KEY, 400, "invalid_json", "not valid JSON"),
    ("/v1/completions", b"[1, 2]", KEY, 400, "invalid_json", "JSON object"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', KEY, 400, "invalid_json", "NaN"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', KEY, 400, "invalid_utf8", "UTF-8"),
    ("/v1/completions", {**GOOD, "max_tokens": "5"}, KEY, 400, "invalid_value", "max_tokens"),
    ("/v1/completions", {**GOOD, "n": True}, KEY, 400, "invalid_value", "n:"),
    ("/v1/completions", {**GOOD, "prompt": 5}, KEY, 400, "invalid_value", "prompt"),
    ("/v1/completions", {**GOOD, "prompt": "\ud800"}, KEY, 400, "invalid_value", "surrogate"),
    ("/v1/completions", {**GOOD, "prompt": [1, 99999]}, KEY, 400, "invalid_value", "vocabulary"),
    ("/v1/completions", {**GOOD, "prompt": ["a"] * (BATCH + 1)}, KEY, 400, "invalid_value", "max_batch_size"),
    ("/v1/completions", {**GOOD, "stream": "yes"}, KEY, 400, "invalid_value", "stream"),
    ("/v1/completions", {**GOOD, "max_tokens": -1}, KEY, 400, "invalid_value", "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, KEY, 400, "invalid_value", "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": MAX_SEQ - 1}, KEY, 400, "context_length_exceeded",
     f"max_seq_len={MAX_SEQ}"),
    ("/v1/completions", {**GOOD, "temperature": -0.5}, KEY, 400, "invalid_value", "temperature"),
    ("/v1/completions", {**GOOD, "top_p": 0}, KEY, 400, "invalid_value", "top_p"),
    ("/v1/completions", {**GOOD, "presence_penalty": 3}, KEY, 400, "invalid_value", "presence_penalty"),
    ("/v1/completions", {**GOOD, "logprobs": 21}, KEY, 400, "invalid_value", "logprobs"),
    ("/v1/completions", {**GOOD, "stop": ["a", ""]}, KEY, 400, "invalid_value", "stop"),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, KEY, 400, "invalid_value", "stream"),
    ("/v1/completions", {**GOOD, "echo": True, "logprobs": 1}, KEY, 400, "invalid_value", "echo"),
    ("/v1/completions", {**GOOD, "logit_bias": {"1": 5}}, KEY, 400, "unsupported_parameter", "logit_bias"),
    ("/v1/completions", {**GOOD, "suffix": "x"}, KEY, 400, "unsupported_parameter", "suffix"),
    ("/v1/completions", {**GOOD, "bogus": 1}, KEY, 400, "invalid_value", "unknown parameter"),
    ("/v1/completions", {**GOOD, "model": "gpt-4"}, KEY, 404, "model_not_found", "gpt-4"),
    ("/v1/completions", GOOD, None, 401, "invalid_api_key", "missing API key"),
    ("/v1/completions", GOOD, "wrong", 401, "invalid_api_key", "incorrect API key"),
    ("/v1/completions", {**GOOD, "prompt": "a" * (MAX_INPUT + 1)}, KEY, 400, "context_length_exceeded",
     f"max_input_len={MAX_INPUT}"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a" * MAX_INPUT}]}, KEY, 400,
     "context_length_exceeded", f"max_input_len={MAX_INPUT}"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, KEY, 400, "invalid_value", "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": "hi"}, KEY, 400, "invalid_value", "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, KEY, 400, "invalid_value",
     "role"),
    ("/v1/chat/completions", {**CHAT, "tools": []}, KEY, 400, "unsupported_parameter", "tool"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, KEY, 400,
     "unsupported_parameter", "response_format"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2, "max_completion_tokens": 2}, KEY, 400, "invalid_value",
     "not both"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, KEY, 400, "invalid_value", "logprobs"),
    ("/v1/nothing", GOOD, KEY, 404, "not_found", "Not Found"),
]


@pytest.mark.parametrize("path, body, key, status, code, words", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input(base, path, body, key, status, code, words):
    response = post(base, path, body, key)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and words in error["message"]
    assert error["type"] == "invalid_request_error"
    assert post(base, "/v1/completions", GOOD).status_code == 200


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_too_large(base, chunked):
    body = b'{"model": "tiny", "prompt": "' + b"a" * (20 * 2**20) + b'"}'
    content = iter([body[i:i + 2**20] for i in range(0, len(body), 2**20)]) if chunked else body
    response = httpx.post(f"{base}/v1/completions", content=content, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    assert str(4 * 2**20) in response.json()["error"]["message"]
    assert post(base, "/v1/completions", GOOD).status_code == 200


def test_openai_client_errors(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=str(client.base_url), api_key="nope", max_retries=0).models.list()


# --- health, metrics, logging -----------------------------------------------------------------------------

def test_health_and_metrics(base):
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    before = metric(base, "kiln_generation_tokens_total")
    ttft = metric(base, "kiln_time_to_first_token_seconds_count")
    assert post(base, "/v1/completions", {**GOOD, "max_tokens": 5, "temperature": 0}).status_code == 200
    assert metric(base, "kiln_generation_tokens_total") == before + 5
    assert metric(base, "kiln_time_to_first_token_seconds_count") == ttft + 1
    for name in ("kiln_time_per_output_token_seconds_count", "kiln_e2e_request_latency_seconds_count",
                 "kiln_prompt_tokens_total", "kiln_kv_blocks_total", "kiln_requests_waiting",
                 "kiln_prefix_cache_hit_rate", "kiln_spec_draft_tokens", "kiln_spec_mean_accepted_length"):
        metric(base, name)
    assert metric(base, "kiln_requests_total", '{route="/v1/completions",status="200"}') >= 1
    assert metric(base, "kiln_requests_total", '{route="/v1/completions",status="401"}') >= 1
    assert httpx.get(f"{base}/metrics").headers["content-type"].startswith("text/plain")


def test_log_lines(base, caplog):
    with caplog.at_level(logging.INFO, logger="kiln.server"):
        response = post(base, "/v1/completions", {**GOOD, "prompt": "secret words", "user": "u-42", "temperature": 0})
        deadline = time.time() + 10            # the line is written once the server has finished the response,
        while time.time() < deadline:          # which may be just after the client has read it
            lines = [r.getMessage() for r in caplog.records if response.headers["x-request-id"] in r.getMessage()]
            if lines:
                break
            time.sleep(0.05)
    assert lines, "no log line for the request"
    line = lines[0]
    assert re.search(r"status=200 prompt_tokens=12 completion_tokens=2 latency_ms=[\d.]+ user='u-42'$", line), line
    assert "secret" not in line


def test_the_page_is_served(base):
    page = httpx.get(base)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in page.text
    assert not re.search(r"""(src|href)=["']https?://""", page.text), "the page must not load anything remote"


# --- packaging and the CLI ----------------------------------------------------------------------------------

def test_core_imports_without_fastapi():
    code = ("import sys; sys.modules['fastapi'] = None; import kiln; from kiln import LLM, SamplingConfig\n"
            "from kiln.cli.main import main\n"
            "assert main(['serve', 'nowhere']) == 2")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "kiln[serve]" in result.stderr


def wait_until_serving(proc: subprocess.Popen, url: str) -> None:
    """Until a `kiln serve` process answers /health."""
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "kiln serve did not start"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health").status_code == 200:
                return
        time.sleep(0.2)


@pytest.mark.skipif(shutil.which("kiln") is None, reason="package scripts not installed")
def test_cli_serve(tiny_dir):
    port = _free_port()
    env = {**os.environ, "KILN_API_KEY": "from-env"}
    proc = subprocess.Popen(["kiln", "serve", str(tiny_dir), "--port", str(port), "--kv_cache_max_tokens", "2048",
                             "--max-queue", "4"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(proc, url)
        good = {**GOOD, "model": "tiny-llama"}       # the directory's name
        assert post(url, "/v1/completions", good, key="from-env").json()["choices"][0]["finish_reason"] == "length"
        assert post(url, "/v1/completions", good, key=None).status_code == 401
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode in (0, -signal.SIGTERM), stderr      # uvicorn re-raises the signal once it has stopped
    assert "Application shutdown complete" in stderr
    assert re.search(r"request_id=\w+ POST /v1/completions status=200 prompt_tokens=\d+ completion_tokens=2", stderr)


# --- SmolLM2: the chat template -----------------------------------------------------------------------------

@pytest.mark.slow
def test_smollm2_chat(smollm2_model):
    build = BuildConfig(max_batch_size=4, max_input_len=256, max_seq_len=512)
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    with LLM(smollm2_model, build_config=build, quiet=True) as smol, run_server(smol) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0)
        streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0,
                                                  stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == plain.choices[0].message.content
        assert "Paris" in plain.choices[0].message.content
        assert plain.usage.prompt_tokens == len(smol.apply_chat_template(messages))


# --- the chat page in headless Chromium ---------------------------------------------------------------------

def _chromium():
    webdriver = pytest.importorskip("selenium.webdriver")
    binary = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        pytest.skip("no Chromium and chromedriver installed (apt-get install chromium chromium-driver)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver_path), options=options)


def test_chat_page_in_chromium(base, client):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser = _chromium()
    try:
        browser.get(base)
        browser.find_element(By.ID, "api-key").send_keys(KEY)
        for field, value in (("temperature", "0"), ("max-tokens", "40")):
            browser.find_element(By.ID, field).clear()
            browser.find_element(By.ID, field).send_keys(value)
        WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "model").text == MODEL)
        browser.find_element(By.ID, "message").send_keys("Hello from the browser")
        browser.find_element(By.ID, "send").click()
        answer = browser.find_elements(By.CSS_SELECTOR, ".assistant")
        WebDriverWait(browser, 60).until(lambda b: answer[0].get_attribute("data-state") != "streaming")
        assert answer[0].get_attribute("data-state") == "done"
        expected = client.chat.completions.create(model=MODEL, max_tokens=40, temperature=0, messages=[
            {"role": "user", "content": "Hello from the browser"}]).choices[0].message.content
        assert answer[0].get_property("textContent") == expected
        assert int(answer[0].get_attribute("data-chunks")) > 1, "the answer was not streamed"
    finally:
        browser.quit()
