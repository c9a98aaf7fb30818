"""``continue_final_message`` (transformers' and vLLM's): the prompt ends right after the last message's
text, so the model continues it, in ``apply_chat_template``, ``LLM.chat``, the chat and tokenize
endpoints, and Anthropic's Messages API, where a final assistant message is a prefill; bad
combinations are clear errors."""

from __future__ import annotations

import pytest

import oxibonsai as ob

from server_support import post

PREFILL = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What does the os module provide?"},
    {"role": "assistant", "content": "The os module provides "},
]


def test_the_prompt_ends_inside_the_last_message():
    tokenizer = ob.LLM(None).tokenizer
    closed = tokenizer.apply_chat_template(PREFILL, add_generation_prompt=False)
    opened = tokenizer.apply_chat_template(PREFILL, add_generation_prompt=False, continue_final_message=True)
    assert opened.endswith("The os module provides") and closed.startswith(opened) and closed != opened
    with pytest.raises(ValueError, match="needs add_generation_prompt=False"):
        tokenizer.apply_chat_template(PREFILL, continue_final_message=True)
    with pytest.raises(ValueError, match="no text to continue"):
        empty = [*PREFILL[:2], {"role": "assistant", "content": "  "}]
        tokenizer.apply_chat_template(empty, add_generation_prompt=False, continue_final_message=True)


def test_chat_continues_the_message():
    llm = ob.LLM(None)
    params = ob.SamplingParams(max_tokens=8, temperature=0)
    tokenizer = llm.tokenizer
    text = tokenizer.apply_chat_template(PREFILL, add_generation_prompt=False, continue_final_message=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    want = llm.generate([{"prompt": text, "prompt_token_ids": ids}], params)[0]
    got = llm.chat(PREFILL, params, add_generation_prompt=False, continue_final_message=True)[0]
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_the_endpoints_continue_the_message(default_app, default_engine):
    tokenizer = default_engine.tokenizer
    text = tokenizer.apply_chat_template(PREFILL, add_generation_prompt=False, continue_final_message=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    body = {"messages": PREFILL, "max_tokens": 4, "temperature": 0}
    r = post(default_app, "/v1/chat/completions", {**body, "continue_final_message": True})
    assert r.status_code == 400 and "cannot both be true" in r.text
    r = post(
        default_app,
        "/v1/chat/completions",
        {**body, "continue_final_message": True, "add_generation_prompt": False},
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
    tokenized = {"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": False}
    assert post(default_app, "/tokenize", tokenized).json()["tokens"] == ids
    # Anthropic's Messages API: a final assistant message is a prefill.
    messages = {"model": "bonsai", "max_tokens": 4, "system": PREFILL[0]["content"], "messages": PREFILL[1:]}
    counted = post(default_app, "/v1/messages/count_tokens", messages).json()["input_tokens"]
    assert counted == len(ids)
    usage = post(default_app, "/v1/messages", messages).json()["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(ids)
