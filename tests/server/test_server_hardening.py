"""`kiln serve` against a hostile client (issue 26): one request's failure fails it alone, queue slots always come
back, no empty API key, CPU work off the event loop, every malformed body a 400 on a connection that stays
usable, OpenAI's fields (name, refusal, system_fingerprint), JSON bodies only, quiet disconnects."""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from kiln import LLM, BuildConfig, SamplingConfig  # noqa: E402
from conftest import MARKER  # noqa: E402
from test_server import (BATCH, GOOD, KEY, LONG, MAX_INPUT, MAX_SEQ, MODEL, _free_port, metric,  # noqa: E402
                         post, run_server, wait_for_idle, wait_until_serving)
from test_server import base, llm, long_prompts, tiny_dir  # noqa: E402,F401 - module fixtures: this module gets its own

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


def _health(base: str) -> int:
    return httpx.get(f"{base}/health", timeout=30).status_code


# --- 0: one request cannot stop the engine ---------------------------------------------------------------

@pytest.mark.parametrize("body", [{**CHAT, "temperature": 1e-40}, {**CHAT, "top_p": 1e-320}],
                         ids=["denormal temperature", "denormal top_p"])
def test_denormal_sampling_is_refused(base, body):
    response = post(base, "/v1/chat/completions", body)
    assert response.status_code == 400 and "denormal" in response.json()["error"]["message"]
    assert _health(base) == 200
    assert post(base, "/v1/chat/completions", {**CHAT, "temperature": 1.0}).status_code == 200


def test_a_failing_request_fails_alone_over_http(base, llm, failing_sampler):
    sampled = {"model": MODEL, "max_tokens": 8, "temperature": 1.0, "seed": 1}
    failed = post(base, "/v1/completions", {**sampled, "prompt": MARKER})
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["code"] == "internal_error" and "injected sampling failure" in error["message"]
    with httpx.stream("POST", f"{base}/v1/completions", json={**sampled, "prompt": MARKER, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as stream:
        lines = [line for line in stream.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and "injected sampling failure" in lines[-2]
    assert post(base, "/v1/completions", {**sampled, "prompt": [1, 2, 3]}).status_code == 200
    assert _health(base) == 200 and llm.healthy()
    wait_for_idle(base)


# --- 1: every queue slot comes back -------------------------------------------------------------------

@pytest.fixture(scope="module")
def no_tokenizer_llm(tiny_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("no-tokenizer") / "tiny"
    path.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (path / name).write_bytes((tiny_dir / name).read_bytes())
    build = BuildConfig(max_batch_size=BATCH, max_input_len=MAX_INPUT, max_output_len=MAX_SEQ - 1,
                        max_seq_len=MAX_SEQ)
    with LLM(path, build_config=build, quiet=True) as llm:
        assert llm.tokenizer is None
        yield llm


def test_a_refused_echo_gives_its_queue_slot_back(no_tokenizer_llm):
    with run_server(no_tokenizer_llm, max_queue=0) as (url, _):
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "echo": True}
        for _ in range(BATCH + 1):
            response = post(url, "/v1/completions", body, key=None)
            assert response.status_code == 400 and response.json()["error"]["param"] == "echo"
        assert metric(url, "kiln_server_requests_in_flight") == 0
        assert post(url, "/v1/completions", {**body, "echo": False}, key=None).status_code == 200


# --- 2: no empty API key; a warning when exposed without one --------------------------------------------

@pytest.mark.parametrize("flag, env", [(["--api-key", ""], {}), ([], {"KILN_API_KEY": ""}),
                                       (["--api-key", " key "], {})], ids=["flag", "env", "whitespace"])
def test_cli_refuses_an_empty_api_key(tiny_dir, flag, env):
    result = subprocess.run(["kiln", "serve", str(tiny_dir), "--port", str(_free_port()), *flag],
                            env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "API key must not" in result.stderr


def test_cli_warns_when_exposed_without_a_key(tiny_dir):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "KILN_API_KEY"}
    proc = subprocess.Popen(["kiln", "serve", str(tiny_dir), "--host", "0.0.0.0", "--port", str(port),
                             "--kv_cache_max_tokens", "2048"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_serving(proc, f"http://127.0.0.1:{port}")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert "WARNING" in stderr and "WITHOUT AN API KEY" in stderr


# --- 3: CPU work off the event loop; hopeless prompts refused before tokenising -------------------------

def test_a_huge_chat_does_not_stall_the_server(base, llm, monkeypatch):
    """100,000 messages take seconds to render: /health is answered while they render."""
    started, ended, original = threading.Event(), [], llm.apply_chat_template

    def timed(messages):
        started.set()
        try:
            return original(messages)
        finally:
            ended.append(time.monotonic())

    monkeypatch.setattr(llm, "apply_chat_template", timed)
    body = {**CHAT, "messages": [{"role": "user", "content": ""}] * 100_000}
    big: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: big.append(post(base, "/v1/chat/completions", body)))
    sender.start()
    assert started.wait(60)
    assert _health(base) == 200
    answered = time.monotonic()
    sender.join(120)
    assert answered < ended[0], "/health waited for the chat template"
    assert big[0].status_code == 400 and big[0].json()["error"]["code"] == "context_length_exceeded"


def test_a_hopeless_prompt_is_refused_before_tokenising(base, llm, monkeypatch):
    calls = []
    original = llm.tokenizer.encode
    monkeypatch.setattr(llm.tokenizer, "encode", lambda *a, **k: calls.append(1) or original(*a, **k))
    response = post(base, "/v1/completions", {**GOOD, "prompt": "a" * (3 * 2**20)})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and f"max_input_len={MAX_INPUT}" in error["message"]
    assert calls == []
    chat = post(base, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a" * 2**20}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    ids = post(base, "/v1/completions", {**GOOD, "prompt": [1] * (MAX_INPUT + 1), "echo": True})
    assert ids.status_code == 400 and ids.json()["error"]["code"] == "context_length_exceeded"


# --- 4: malformed bodies: a 400 with OpenAI's body, on a connection that stays usable -----------------

def _request(body: bytes, content_length: int | None = None, content_type: str = "application/json") -> bytes:
    length = len(body) if content_length is None else content_length
    return (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {length}\r\n\r\n").encode() + body


def _response(reader) -> tuple[int, dict]:
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline().decode().strip()):
        name, _, value = line.partition(":")
        headers[name.lower()] = value.strip()
    return status, json.loads(reader.read(int(headers["content-length"])))


@contextlib.contextmanager
def _connection(base: str):
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock, sock.makefile("rb") as reader:
        yield sock, reader


GOOD_BYTES = json.dumps(GOOD).encode()
MALFORMED = [  # (body, code, words in the message)
    (b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "invalid_json", "32 deep"),
    (b'{"model": "tiny", "prompt": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}", "invalid_json", "32 deep"),
    (b'{"model": "\\ud800", "prompt": "hi"}', "invalid_value", "surrogate"),
    (b'{"model": "tiny", "prompt": "hi", "user": "\\udfff"}', "invalid_value", "surrogate"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": 1e-40}', "invalid_value", "denormal"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 1e400}', "invalid_value", "max_tokens"),
]


@pytest.mark.parametrize("body, code, words", MALFORMED, ids=["deep", "40 deep", "model", "user", "temperature",
                                                             "inf"])
def test_malformed_bodies_get_400_and_the_connection_lives(base, body, code, words):
    with _connection(base) as (sock, reader):
        sock.sendall(_request(body))
        status, answer = _response(reader)
        assert status == 400 and answer["error"]["code"] == code and words in answer["error"]["message"], answer
        sock.sendall(_request(GOOD_BYTES))
        assert _response(reader)[0] == 200


def test_a_short_body_times_out_with_408(llm):
    with run_server(llm, body_timeout=0.5) as (url, _), _connection(url) as (sock, reader):
        sock.sendall(_request(GOOD_BYTES[:10], content_length=len(GOOD_BYTES) + 50))
        status, answer = _response(reader)
    assert status == 408 and answer["error"]["code"] == "request_timeout"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_only_json_bodies_are_read(base, content_type):
    headers = {"Authorization": f"Bearer {KEY}", **({"Content-Type": content_type} if content_type else {})}
    response = httpx.post(f"{base}/v1/completions", content=GOOD_BYTES, headers=headers, timeout=30)
    assert response.status_code == 415 and response.json()["error"]["code"] == "unsupported_media_type"
    with_charset = {**headers, "Content-Type": "application/json; charset=utf-8"}
    assert httpx.post(f"{base}/v1/completions", content=GOOD_BYTES, headers=with_charset, timeout=30).status_code == 200


# --- 6: OpenAI conformance, quiet disconnects ---------------------------------------------------------

def test_openai_fields(base):
    chat = post(base, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi", "name": "ann"}]})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["choices"][0]["message"]["refusal"] is None and body["system_fingerprint"].startswith("fp_")
    completion = post(base, "/v1/completions", GOOD).json()
    assert completion["system_fingerprint"] == body["system_fingerprint"]
    bad_name = post(base, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "name": 5}]})
    assert bad_name.status_code == 400


def test_logprobs_leave_out_the_end_token(base, llm, monkeypatch):
    """The content omits the end token; so do its logprobs (plain and streamed, chat and completions)."""
    prompt = llm.apply_chat_template(CHAT["messages"])
    tokens = llm.generate(prompt, SamplingConfig(max_new_tokens=8, temperature=0)).outputs[0].token_ids
    end = next(t for t in tokens if t != tokens[0])
    shown = tokens.index(end)                       # the tokens before the first occurrence of the new end token
    monkeypatch.setattr(llm, "eos_ids", [end])
    body = {**CHAT, "max_tokens": 8, "logprobs": True}
    plain = post(base, "/v1/chat/completions", body).json()["choices"][0]
    assert plain["finish_reason"] == "stop" and len(plain["logprobs"]["content"]) == shown
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    streamed = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["content"]]
    assert streamed == plain["logprobs"]["content"]
    text = post(base, "/v1/completions", {**GOOD, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                                          "logprobs": 0}).json()["choices"][0]
    assert text["finish_reason"] == "stop" and len(text["logprobs"]["tokens"]) == shown


def test_a_disconnect_logs_no_error(base, long_prompts, caplog):
    body = {"model": MODEL, "prompt": long_prompts[0], "max_tokens": LONG, "temperature": 0}   # runs for seconds
    with caplog.at_level(logging.WARNING):
        with pytest.raises(httpx.ReadTimeout):
            post(base, "/v1/completions", body, timeout=0.3)
        wait_for_idle(base)
        gc.collect()
        time.sleep(0.2)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
