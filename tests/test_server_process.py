"""``python -m oxibonsai serve`` as a user runs it, driven by the official ``openai`` client over a real
socket: completions and chat, sync and streaming, ``n``, logprobs, errors as the client's exception
classes, tool calls from a real (scripted) model, and SIGTERM draining."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from scripted_model import CALL_JSON, WEATHER_TOOL, write_scripted_model
from server_support import free_port, server_process

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")


def client(url: str, **kw: Any) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw)


@pytest.fixture(scope="module")
def default_server() -> Iterator[str]:
    with server_process("--served-model-name", "bonsai", "--max-num-seqs", "4") as (url, _):
        yield url


def test_completion_and_chat_sync(default_server: str) -> None:
    c = client(default_server)
    assert [m.id for m in c.models.list().data] == ["bonsai"]
    comp = c.completions.create(model="bonsai", prompt="The os module", max_tokens=8, temperature=0)
    assert comp.choices[0].finish_reason in ("stop", "length") and comp.usage.completion_tokens >= 1
    chat = c.chat.completions.create(
        model="bonsai", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=8, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens_details.cached_tokens is not None


def test_streaming_chat_matches_the_full_answer_and_reports_usage(default_server: str) -> None:
    c = client(default_server)
    messages = [{"role": "user", "content": f"list {random.randrange(10**6)} files"}]
    full = c.chat.completions.create(model="bonsai", messages=messages, max_tokens=12, temperature=0)
    chunks = list(
        c.chat.completions.create(
            model="bonsai",
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n_and_logprobs_through_the_client(default_server: str) -> None:
    c = client(default_server)
    r = c.chat.completions.create(
        model="bonsai",
        messages=[{"role": "user", "content": "os"}],
        max_tokens=6,
        n=3,
        seed=random.randrange(2**31),
        logprobs=True,
        top_logprobs=2,
    )
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    for ch in r.choices:
        assert ch.logprobs is not None and all(len(t.top_logprobs) == 2 for t in ch.logprobs.content)
    comp = c.completions.create(model="bonsai", prompt="os", max_tokens=4, logprobs=2, n=2, stream=True)
    indices = {chunk.choices[0].index for chunk in comp}
    assert indices == {0, 1}


def test_errors_surface_as_the_clients_exceptions(default_server: str) -> None:
    c = client(default_server)
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model="bonsai", prompt="os", max_tokens=-1)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="other", prompt="os")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        c.completions.create(model="bonsai", prompt="os", max_tokens=10**6)


def test_api_key_from_the_environment(tmp_path: Path) -> None:
    with server_process(env={"OXIBONSAI_API_KEY": "sekrit"}) as (url, _):
        with pytest.raises(openai.AuthenticationError):
            client(url, api_key="wrong").models.list()
        assert client(url, api_key="sekrit").models.list().data


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    script = ["<tool_call>", "\n" + CALL_JSON + "\n", "</tool_call>", "<|im_end|>"]
    path = write_scripted_model(tmp_path_factory.mktemp("scripted") / "tools.gguf", script)
    with server_process("--model", str(path), "--served-model-name", "qwen3-tools") as (url, _):
        yield url


def test_tool_calls_come_back_as_tool_calls(tool_server: str) -> None:
    c = client(tool_server)
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    r = c.chat.completions.create(model="qwen3-tools", messages=messages, tools=[WEATHER_TOOL], temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    plain = c.chat.completions.create(model="qwen3-tools", messages=messages, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.tool_calls is None
    assert "<tool_call>" in plain.choices[0].message.content


def test_tool_calls_stream(tool_server: str) -> None:
    c = client(tool_server)
    messages = [{"role": "user", "content": "Weather?"}]
    chunks = list(
        c.chat.completions.create(
            model="qwen3-tools", messages=messages, tools=[WEATHER_TOOL], temperature=0, stream=True
        )
    )
    deltas = [ch.choices[0] for ch in chunks if ch.choices]
    assert "".join(d.delta.content or "" for d in deltas).strip() == ""
    calls = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert deltas[-1].finish_reason == "tool_calls"
    assert "<tool_call>" not in "".join(d.delta.content or "" for d in deltas)


def test_tool_results_go_back_into_the_template(tool_server: str) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": CALL_JSON},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = httpx.post(
        tool_server + "/tokenize", json={"messages": messages, "tools": [WEATHER_TOOL]}, timeout=30
    )
    assert r.status_code == 200, r.text
    text = httpx.post(tool_server + "/detokenize", json={"tokens": r.json()["tokens"]}, timeout=30).json()[
        "prompt"
    ]
    assert "<tool_response>\nsunny\n</tool_response>" in text and '"name": "get_weather"' in text


def _stream_text(url: str, max_tokens: int) -> tuple[str, str | None]:
    body = {"prompt": "os", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    text, finish = "", None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    return text, finish


def _wait_for_admitted(url: str, n: int) -> None:
    """Until the engine holds ``n`` requests, running or waiting."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = httpx.get(url + "/metrics", timeout=5).text.splitlines()
        held = sum(
            float(x.split()[-1])
            for x in lines
            if x.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))
        )
        if held >= n:
            return
        time.sleep(0.01)
    raise AssertionError("requests were not admitted")


def test_sigterm_drains_running_requests_then_exits_0() -> None:
    """Eight long requests run one at a time (a few seconds of work on the default model): after the
    signal the server refuses new work and reports not ready, and every accepted request finishes."""
    with server_process("--shutdown-timeout", "60", "--max-num-seqs", "1") as (url, proc):
        pool = concurrent.futures.ThreadPoolExecutor(8)
        streams = [pool.submit(_stream_text, url, 480) for _ in range(8)]
        _wait_for_admitted(url, 8)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        assert proc.poll() is None, "the server must wait for its requests"
        assert httpx.get(url + "/ready", timeout=5).status_code == 503
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        late = httpx.post(url + "/v1/completions", json={"prompt": "os"}, timeout=5)
        assert late.status_code == 503
        assert [f.result(timeout=120)[1] for f in streams] == ["length"] * 8
        assert proc.wait(timeout=60) == 0


def _raw_exchange(url: str, head: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        try:
            sock.sendall(head)
        except OSError:  # the server may close while we are still sending
            pass
        chunks = []
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)


def test_oversized_request_heads_are_refused(default_server: str) -> None:
    big = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (5 << 20) + b"\r\nConnection: close\r\n\r\n"
    answer = _raw_exchange(default_server, big)
    assert answer == b"" or answer.split(b" ", 2)[1] in (b"400", b"413", b"431")
    assert httpx.get(default_server + "/health", timeout=5).status_code == 200


def _non_loopback_address() -> str | None:
    """An address of this machine other than loopback, if it has one (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks the outgoing interface
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_binds_loopback_only_by_default(default_server: str) -> None:
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address")
    port = int(default_server.rsplit(":", 1)[1])
    with pytest.raises(OSError), socket.create_connection((address, port), timeout=5):
        pass


def test_a_model_that_fails_to_load_ends_the_process_with_status_1(tmp_path: Path) -> None:
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 10)
    port = str(free_port())
    cmd = [sys.executable, "-m", "oxibonsai", "serve", "--model", str(bad), "--port", port]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "GGUF" in done.stdout + done.stderr or "gguf" in (done.stdout + done.stderr).lower()
