"""Tokenizer from GGUF metadata: encodes and decodes exactly like the HF tokenizer it was exported from."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HfTokenizer

from oxibonsai.tokenizer import Tokenizer

from tokenizer_fixture import (
    CONTROL_TOKENS,
    USER_DEFINED_TOKENS,
    make_tokenizer_metadata,
    train_reference_tokenizer,
)

TRICKY_PIECES = [
    " ", "   ", "\n", "\r\n", "\t", "\r", "0", "42", "123456", "'s", "'LL", "Hello", " world", "é", "e\u0301",
    "中文", "日本語", "😀", "👍🏽", "🇫🇷", "\u200d", "\ufffd", "\x00", "<|im_start|>", "<|im_end|>", "<think>",
    "</think>", "<|endoftext|>", "<|im_end", "|>", "<", "\u017f",
]  # fmt: skip
texts = st.one_of(st.text(), st.lists(st.sampled_from(TRICKY_PIECES), max_size=40).map("".join))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(make_tokenizer_metadata())


@pytest.fixture(scope="module")
def ref() -> HfTokenizer:
    return train_reference_tokenizer()


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_encodes_like_the_trained_tokenizer_and_round_trips(
    tok: Tokenizer, ref: HfTokenizer, text: str
) -> None:
    ids = tok.encode(text)
    assert ids == ref.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_decode_matches_hf_on_arbitrary_ids(tok: Tokenizer, ref: HfTokenizer, data: st.DataObject) -> None:
    # Arbitrary ids include lone bytes of multi-byte characters and special tokens between them.
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=30))
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_added_tokens_encode_to_single_ids(tok: Tokenizer) -> None:
    for token in (*CONTROL_TOKENS, *USER_DEFINED_TOKENS):
        token_id = tok.token_to_id(token)
        assert token_id is not None
        ids = tok.encode(f"a{token}b")
        assert ids == [*tok.encode("a"), token_id, *tok.encode("b")]
        assert tok.convert_ids_to_tokens(token_id) == token


def test_decode_skips_control_tokens_but_keeps_user_defined_ones(tok: Tokenizer) -> None:
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\nok<|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "assistant\n<think>\nhm\n</think>\n\nok"


def test_special_ids_and_vocabulary_lookups(tok: Tokenizer) -> None:
    meta = make_tokenizer_metadata()
    tokens = meta["tokenizer.ggml.tokens"]
    im_end, endoftext = tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")
    assert tok.vocab_size == len(tokens)
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (im_end, endoftext, endoftext)
    assert tok.stop_token_ids == {im_end, endoftext}
    assert tok.special_token_ids == {tokens.index(t) for t in CONTROL_TOKENS}
    assert tok.chat_template == meta["tokenizer.chat_template"]
    world = tok.encode(" world")
    assert tok.convert_ids_to_tokens(world) == [tokens[i] for i in world]
    assert all(tok.token_to_id(tokens[i]) == i for i in world)
    assert tok.token_to_id("not a token") is None
    assert isinstance(tok.hf, HfTokenizer)


def test_bos_and_eos_are_added_only_when_the_file_asks() -> None:
    meta = make_tokenizer_metadata()
    plain = Tokenizer.from_gguf_metadata(meta)
    assert plain.encode("hi") == plain.encode("hi", add_special_tokens=False)
    meta["tokenizer.ggml.add_bos_token"] = True
    meta["tokenizer.ggml.add_eos_token"] = True
    tok = Tokenizer.from_gguf_metadata(meta)
    body = tok.encode("hi", add_special_tokens=False)
    assert tok.encode("hi") == [tok.bos_token_id, *body, tok.eos_token_id]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    assert prompt[0] != tok.bos_token_id


def test_eot_token_id_is_a_stop_token() -> None:
    meta = make_tokenizer_metadata()
    meta["tokenizer.ggml.eot_token_id"] = 700
    assert 700 in Tokenizer.from_gguf_metadata(meta).stop_token_ids


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("qwen2", ["1", "2", "3", "4", "5", "Ġapples", "'S"]),
        ("llama-bpe", ["123", "45", "Ġapples", "'S"]),
        ("gpt-2", ["12345", "Ġapples", "'", "S"]),
        ("default", ["12345", "Ġapples", "'", "S"]),
    ],
)
def test_pre_tokenizer_follows_tokenizer_ggml_pre(pre: str, pieces: list[str]) -> None:
    meta = make_tokenizer_metadata()
    meta["tokenizer.ggml.pre"] = pre
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.hf.pre_tokenizer is not None
    assert [p for p, _ in tok.hf.pre_tokenizer.pre_tokenize_str("12345 apples'S")] == pieces


def _without(key: str) -> dict[str, Any]:
    meta = make_tokenizer_metadata()
    del meta[key]
    return meta


def _with(key: str, value: Any) -> dict[str, Any]:
    meta = make_tokenizer_metadata()
    meta[key] = value
    return meta


def _merges_with(bad: str) -> dict[str, Any]:
    meta = make_tokenizer_metadata()
    meta["tokenizer.ggml.merges"] = [*meta["tokenizer.ggml.merges"][:5], bad]
    return meta


def _duplicate_token() -> dict[str, Any]:
    meta = make_tokenizer_metadata()
    meta["tokenizer.ggml.tokens"][10] = meta["tokenizer.ggml.tokens"][11]
    return meta


BAD_METADATA = [
    (_without("tokenizer.ggml.model"), "tokenizer.ggml.model"),
    (
        _with("tokenizer.ggml.model", "llama"),
        r"unsupported tokenizer model 'llama' \(only byte-level BPE 'gpt2'",
    ),
    (_without("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens"),
    (_with("tokenizer.ggml.tokens", "abc"), "'tokenizer.ggml.tokens' must be an array"),
    (_with("tokenizer.ggml.tokens", ["a", 3]), r"'tokenizer.ggml.tokens'\[1\] must be a non-empty string"),
    (_duplicate_token(), "'tokenizer.ggml.tokens' has .* twice, at ids 10 and 11"),
    (_with("tokenizer.ggml.token_type", [1, 1]), "'tokenizer.ggml.token_type' has 2 entries but"),
    (_with("tokenizer.ggml.token_type", [9] * 800), r"'tokenizer.ggml.token_type'\[0\] must be a token type"),
    (_without("tokenizer.ggml.merges"), "missing 'tokenizer.ggml.merges'"),
    (_merges_with("a"), r"'tokenizer.ggml.merges'\[5\] must be two tokens"),
    (_merges_with("a  b"), r"'tokenizer.ggml.merges'\[5\] must be two tokens"),
    (_merges_with("zzzz q"), r"'tokenizer.ggml.merges'\[5\] = 'zzzz q': 'zzzz' is not in"),
    (_with("tokenizer.ggml.pre", "nonsense"), "unsupported pre-tokenizer 'nonsense'.*supported: .*qwen2"),
    (_with("tokenizer.ggml.eos_token_id", 800), "'tokenizer.ggml.eos_token_id' = 800 is out of range"),
    (_with("tokenizer.ggml.bos_token_id", -1), "'tokenizer.ggml.bos_token_id' = -1 is out of range"),
    (_with("tokenizer.ggml.padding_token_id", "3"), "'tokenizer.ggml.padding_token_id' must be an integer"),
    (_with("tokenizer.ggml.add_bos_token", 1), "'tokenizer.ggml.add_bos_token' must be a bool"),
    (_with("tokenizer.chat_template", 5), "'tokenizer.chat_template' must be a string"),
]


@pytest.mark.parametrize(("meta", "message"), BAD_METADATA)
def test_bad_metadata_raises_value_error_naming_the_key(meta: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_gguf_metadata(meta)


def test_add_bos_without_bos_id_is_rejected() -> None:
    meta = _with("tokenizer.ggml.add_bos_token", True)
    del meta["tokenizer.ggml.bos_token_id"]
    with pytest.raises(ValueError, match="'tokenizer.ggml.add_bos_token' is true but.*bos_token_id"):
        Tokenizer.from_gguf_metadata(meta)


def test_bad_ids_and_text_are_rejected(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="token id 800 is out of range for a vocabulary of 800"):
        tok.decode([1, 800])
    with pytest.raises(ValueError, match="token id -1 is out of range"):
        tok.convert_ids_to_tokens([-1])
    with pytest.raises(TypeError, match="token id must be an int, got str"):
        tok.decode(["a"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="text must be a str, got bytes"):
        tok.encode(b"abc")  # type: ignore[arg-type]


LLAMA_VOCABS = os.environ.get("OXIBONSAI_LLAMA_VOCABS")


@pytest.mark.skipif(not LLAMA_VOCABS, reason="set OXIBONSAI_LLAMA_VOCABS to llama.cpp's models/ directory")
@pytest.mark.parametrize("name", ["qwen2", "qwen35", "llama-bpe", "gpt-2"])
def test_real_vocabularies_encode_like_llama_cpp_test_files(name: str) -> None:
    """llama.cpp's ggml-vocab-*.gguf files come with inputs and the ids HF tokenizers gives them."""
    gguf = pytest.importorskip("gguf")
    path = Path(str(LLAMA_VOCABS)) / f"ggml-vocab-{name}.gguf"
    fields = gguf.GGUFReader(path).fields
    tok = Tokenizer.from_gguf_metadata(
        {k: f.contents() for k, f in fields.items() if k.startswith("tokenizer")}
    )
    inputs = path.with_suffix(".gguf.inp").read_text("utf-8").split("\n__ggml_vocab_test__\n")
    outputs = path.with_suffix(".gguf.out").read_text("utf-8").split("\n")
    for text, expected in zip(inputs, outputs, strict=False):
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == [int(i) for i in expected.split()], text
        assert tok.decode(ids, skip_special_tokens=False) == text
