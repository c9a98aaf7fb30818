"""The scripted model: greedy generation reproduces its script after chat and plain prompts, and
QWEN3_TOOLS_TEMPLATE renders tools, tool calls and tool responses in Qwen3's layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import oxibonsai

from scripted_model import CALL_JSON, WEATHER_TOOL, write_scripted_model

SCRIPT = ["<tool_call>", CALL_JSON, "</tool_call>", "<|im_end|>"]
CLOCK_TOOL = {"type": "function", "function": {"name": "now", "description": "Heure à Zürich"}}
USER = {"role": "user", "content": "What's the weather in Paris?"}


@pytest.fixture(scope="module")
def tool_llm(tmp_path_factory: pytest.TempPathFactory) -> oxibonsai.LLM:
    path = write_scripted_model(tmp_path_factory.mktemp("scripted") / "tool.gguf", SCRIPT)
    return oxibonsai.LLM(path, kv_cache_blocks=64)


def greedy(
    llm: oxibonsai.LLM, prompt: str | dict[str, Any], max_tokens: int = 16
) -> oxibonsai.CompletionOutput:
    params = oxibonsai.SamplingParams(max_tokens=max_tokens, temperature=0)
    return llm.generate([prompt], params)[0].outputs[0]


def test_chat_prompt_with_tools_generates_the_script(tool_llm: oxibonsai.LLM) -> None:
    prompt = tool_llm.chat_prompt([USER], tools=[WEATHER_TOOL])
    assert tool_llm.tokenizer.decode(prompt["prompt_token_ids"][-1:]) == "\n"
    out = greedy(tool_llm, prompt)
    assert tool_llm.tokenizer.convert_ids_to_tokens(out.token_ids) == SCRIPT
    assert out.text == "<tool_call>" + CALL_JSON + "</tool_call>"
    assert out.finish_reason == "stop"


def test_plain_prompt_ending_in_newline_generates_the_script(tool_llm: oxibonsai.LLM) -> None:
    out = greedy(tool_llm, "Hello world\n")
    assert tool_llm.tokenizer.convert_ids_to_tokens(out.token_ids) == SCRIPT
    assert out.finish_reason == "stop"


def test_qwen3_shaped_tool_call(tmp_path: Path) -> None:
    """Newlines inside the added token give Qwen3's exact output text."""
    script = ["<tool_call>", "\n" + CALL_JSON + "\n", "</tool_call>", "<|im_end|>"]
    llm = oxibonsai.LLM(write_scripted_model(tmp_path / "m.gguf", script), kv_cache_blocks=64)
    out = greedy(llm, llm.chat_prompt([USER], tools=[WEATHER_TOOL]))
    assert out.text == "<tool_call>\n" + CALL_JSON + "\n</tool_call>"
    assert out.finish_reason == "stop"


def test_base_vocabulary_script_cycles_through_start(tmp_path: Path) -> None:
    """Ordinary tokens are reused, not added; without a stop token the script repeats after `start`."""
    llm = oxibonsai.LLM(write_scripted_model(tmp_path / "m.gguf", [" the", " is", "."]), kv_cache_blocks=64)
    assert llm.tokenizer.vocab_size == 800
    out = greedy(llm, "Hello world\n", max_tokens=9)
    assert out.text == " the is.\n the is.\n the"
    assert out.finish_reason == "length"


def test_custom_start_token(tmp_path: Path) -> None:
    path = write_scripted_model(tmp_path / "m.gguf", ["<answer>", "<|im_end|>"], start="<go>")
    llm = oxibonsai.LLM(path, kv_cache_blocks=64)
    assert greedy(llm, "anything <go>").text == "<answer>"


def test_script_tokens_must_be_distinct(tmp_path: Path) -> None:
    for script in (["a", "a"], ["\n", "a"], []):
        with pytest.raises(ValueError, match="distinct"):
            write_scripted_model(tmp_path / "m.gguf", script)


def test_tools_render_into_the_system_turn(tool_llm: oxibonsai.LLM) -> None:
    system = {"role": "system", "content": "Be brief."}
    text = tool_llm.chat_prompt([system, USER], tools=[WEATHER_TOOL, CLOCK_TOOL])["prompt"]
    tools_lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in (WEATHER_TOOL, CLOCK_TOOL))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + tools_lines + "\n</tools>" in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text
    assert text.count("Be brief.") == 1
    assert text.endswith("<|im_start|>user\nWhat's the weather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_no_tools_is_plain_chatml(tool_llm: oxibonsai.LLM) -> None:
    text = tool_llm.chat_prompt([{"role": "system", "content": "S"}, USER])["prompt"]
    assert text == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWhat's the weather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tool_calls_and_tool_responses_render_like_qwen3(tool_llm: oxibonsai.LLM) -> None:
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": {}}},
    ]
    messages: list[dict[str, Any]] = [
        USER,
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "18°C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    ]
    text = tool_llm.chat_prompt(messages)["prompt"]
    assert text.endswith(
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18°C\n</tool_response>\n"
        "<tool_response>\n12:00\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_assistant_text_before_tool_calls_gets_a_newline(tool_llm: oxibonsai.LLM) -> None:
    call = {"function": {"name": "now", "arguments": {}}}
    text = tool_llm.chat_prompt([USER, {"role": "assistant", "content": "Sure.", "tool_calls": [call]}])
    assert '<|im_start|>assistant\nSure.\n<tool_call>\n{"name": "now"' in text["prompt"]


def test_validator_refuses_null_content(tool_llm: oxibonsai.LLM) -> None:
    """OpenAI clients send content null with tool_calls; the server must map it to "" first."""
    call = {"function": {"name": "now", "arguments": {}}}
    with pytest.raises(TypeError, match="must be a str, got NoneType"):
        tool_llm.chat_prompt([USER, {"role": "assistant", "content": None, "tool_calls": [call]}])
