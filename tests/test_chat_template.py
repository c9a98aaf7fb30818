"""Chat templates render like HF transformers' apply_chat_template; bad messages get clear errors."""

from __future__ import annotations

from typing import Any

import pytest

from oxibonsai.chat_template import ChatTemplate, ChatTemplateError
from oxibonsai.tokenizer import Tokenizer

from tokenizer_fixture import chatml, make_tokenizer_metadata

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi 😀, what's 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?\n"},
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(make_tokenizer_metadata())


def test_renders_chatml_with_and_without_generation_prompt(tok: Tokenizer) -> None:
    assert tok.apply_chat_template(CONVERSATION) == chatml(CONVERSATION, "<|im_start|>assistant\n")
    assert tok.apply_chat_template(CONVERSATION, add_generation_prompt=False) == chatml(CONVERSATION)
    assert tok.apply_chat_template(CONVERSATION, enable_thinking=True) == chatml(
        CONVERSATION, "<|im_start|>assistant\n"
    )


def test_enable_thinking_false_appends_an_empty_think_block(tok: Tokenizer) -> None:
    rendered = tok.apply_chat_template(CONVERSATION, enable_thinking=False)
    assert rendered == chatml(CONVERSATION, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    no_prompt = tok.apply_chat_template(CONVERSATION, add_generation_prompt=False, enable_thinking=False)
    assert no_prompt == chatml(CONVERSATION)


def test_tokenize_maps_special_tokens_to_their_ids(tok: Tokenizer) -> None:
    rendered = tok.apply_chat_template(CONVERSATION, enable_thinking=False)
    ids = tok.apply_chat_template(CONVERSATION, enable_thinking=False, tokenize=True)
    assert ids == tok.encode(rendered, add_special_tokens=False)
    counts = {tok.convert_ids_to_tokens(i): ids.count(i) for i in set(ids)}
    assert counts["<|im_start|>"] == len(CONVERSATION) + 1
    assert counts["<|im_end|>"] == len(CONVERSATION)
    assert counts["<think>"] == 1
    assert tok.decode(ids, skip_special_tokens=False) == rendered


def _template(source: str) -> ChatTemplate:
    return ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"})


def test_helpers_match_transformers() -> None:
    msgs = [{"role": "user", "content": "héllo"}]
    tools = [{"name": "f", "description": "ü <b>"}]
    source = (
        "{{ bos_token }}{{ messages[0] | tojson }}|{{ tools | tojson(indent=1) }}|{{ eos_token }}"
        "{% for m in messages %}{% if m.role == 'user' %}{% continue %}{% endif %}x{% endfor %}"
        "{% generation %}[{{ extra }}]{% endgeneration %}|{{ strftime_now('%Y') | length }}"
    )
    out = _template(source).render(msgs, add_generation_prompt=True, tools=tools, extra=7)
    assert out == (
        '<s>{"role": "user", "content": "héllo"}|[\n {\n  "name": "f",\n  "description": "ü <b>"\n }\n]|</s>'
        "[7]|4"
    )


def test_trim_and_lstrip_blocks_are_on() -> None:
    source = "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    assert _template(source).render([{"role": "u", "content": "a"}], add_generation_prompt=False) == "a\n"


def test_raise_exception_is_a_value_error() -> None:
    source = "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    with pytest.raises(ValueError, match="system first") as info:
        _template(source).render([{"role": "user", "content": "x"}], add_generation_prompt=True)
    assert isinstance(info.value, ChatTemplateError)


def test_broken_templates_raise_chat_template_errors() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        _template("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="failed"):
        _template("{{ messages.append(1) }}").render(
            [{"role": "u", "content": ""}], add_generation_prompt=True
        )


def test_a_model_without_template_raises_value_error() -> None:
    tok = Tokenizer.from_gguf_metadata(make_tokenizer_metadata(chat_template=None))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template.*tokenizer.chat_template"):
        tok.apply_chat_template(CONVERSATION)


BAD_MESSAGES: list[tuple[Any, type[Exception], str]] = [
    ("hello", TypeError, "messages must be a list of dicts, got str"),
    ({"role": "user", "content": "x"}, TypeError, "messages must be a list of dicts, got dict"),
    ([], ValueError, "messages must not be empty"),
    (
        [{"role": "user", "content": "x"}, ("user", "y")],
        TypeError,
        r"messages\[1\] must be a dict, got tuple",
    ),
    ([{"content": "x"}], ValueError, r"messages\[0\] has no 'role'"),
    ([{"role": "user"}], ValueError, r"messages\[0\] has no 'content'"),
    (
        [{"role": "user", "content": None}],
        TypeError,
        r"messages\[0\]\['content'\] must be a str, got NoneType",
    ),
    ([{"role": 1, "content": "x"}], TypeError, r"messages\[0\]\['role'\] must be a str, got int"),
]


@pytest.mark.parametrize(("messages", "error", "message"), BAD_MESSAGES)
def test_bad_messages_are_rejected(
    tok: Tokenizer, messages: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        tok.apply_chat_template(messages)
