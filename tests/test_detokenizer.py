"""Incremental detokenization adds up to decode(); stop strings never leak, however text is chunked."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oxibonsai.detokenizer import IncrementalDetokenizer, StopStringMatcher
from oxibonsai.tokenizer import Tokenizer

from tokenizer_fixture import make_tokenizer_metadata

# The fixture vocabulary has no merges for these, so their UTF-8 bytes are split across tokens.
MULTIBYTE = ["😀", "👍🏽", "中文", "é", "e\u0301", "\ufffd", "🇫🇷", " ", "\n", "ab", "<|im_end|>", "<think>"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(make_tokenizer_metadata())


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(st.text(), st.lists(st.sampled_from(MULTIBYTE), max_size=30).map("".join)))
def test_deltas_of_encoded_text_are_whole_characters(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("prompt"), skip_special_tokens=False)
    for i, token_id in enumerate(ids):
        detok.add(token_id)
        assert text.startswith(detok.text)
        if not detok.has_partial_character:
            assert detok.text == tok.decode(ids[: i + 1], skip_special_tokens=False)
    assert detok.finish() == ""
    assert detok.text == text


def test_emoji_bytes_really_are_split_across_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) == 4
    detok = IncrementalDetokenizer(tok, ())
    assert [(detok.add(i), detok.has_partial_character) for i in ids] == [
        ("", True),
        ("", True),
        ("", True),
        ("😀", False),
    ]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_deltas_add_up_to_decode_on_arbitrary_ids(tok: Tokenizer, data: st.DataObject, skip: bool) -> None:
    # Arbitrary ids: lone lead and continuation bytes, invalid UTF-8, control tokens in between.
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
    for i, token_id in enumerate(ids):
        detok.add(token_id)
        if not detok.has_partial_character:
            assert detok.text == tok.decode(ids[: i + 1], skip_special_tokens=skip)
    detok.finish()
    assert detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert detok.token_ids == ids


def test_finish_turns_an_unfinished_character_into_a_replacement(tok: Tokenizer) -> None:
    ids = tok.encode("ok😀")[:-1]
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.add(i) for i in ids) == "ok"
    assert detok.has_partial_character
    assert detok.finish() == "\ufffd"
    assert detok.text == tok.decode(ids) == "ok\ufffd"
    with pytest.raises(RuntimeError, match="after finish"):
        detok.add(ids[0])


def test_bad_ids_are_rejected(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="out of range"):
        IncrementalDetokenizer(tok, [tok.vocab_size])
    with pytest.raises(ValueError, match="out of range"):
        IncrementalDetokenizer(tok).add(-1)


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Non-incremental: cut at the first point where a stop string is complete (earlier start on a tie)."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    end, start, stop = min(hits)
    return (text[:end] if include else text[:start]), stop


def stream(matcher: StopStringMatcher, chunks: list[str], expected: str) -> str:
    out = ""
    for chunk in chunks:
        emitted, stopped = matcher.feed(chunk)
        out += emitted
        assert expected.startswith(out)  # nothing past the cut point is ever emitted
        if stopped:
            return out
    return out + matcher.flush()


ALPHABET = st.sampled_from(["a", "b", "c", "😀", "\n"])


@settings(max_examples=500, deadline=None)
@given(
    text=st.lists(ALPHABET, max_size=60).map("".join),
    stops=st.lists(st.lists(ALPHABET, min_size=1, max_size=5).map("".join), max_size=4),
    cuts=st.lists(st.integers(0, 60), max_size=20),
    include=st.booleans(),
)
def test_stop_strings_match_the_reference_under_any_chunking(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    expected, matched = reference_stop(text, stops, include)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    assert stream(matcher, chunks, expected) == expected
    assert matcher.matched == matched


@settings(max_examples=200, deadline=None)
@given(text=st.lists(ALPHABET, max_size=40).map("".join), stop=st.lists(ALPHABET, min_size=1, max_size=6))
def test_at_most_len_minus_one_characters_are_held_back(text: str, stop: list[str]) -> None:
    matcher = StopStringMatcher(["".join(stop)])
    emitted = 0
    for i, ch in enumerate(text):
        out, stopped = matcher.feed(ch)
        if stopped:
            break
        emitted += len(out)
        assert emitted >= i + 1 - (len(stop) - 1)


def test_stop_string_spanning_many_tokens_is_cut_from_detokenized_text(tok: Tokenizer) -> None:
    ids = tok.encode("Answer: 42 😀 END of story END")
    detok, matcher = IncrementalDetokenizer(tok), StopStringMatcher(["😀 END", "story"])
    out = ""
    for token_id in ids:
        emitted, stopped = matcher.feed(detok.add(token_id))
        out += emitted
        if stopped:
            break
    assert (out, matcher.matched, matcher.stopped) == ("Answer: 42 ", "😀 END", True)
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_first_completed_stop_wins_and_include_keeps_it() -> None:
    for chunks in (["abcd"], ["a", "b", "c", "d"], ["ab", "cd"]):
        matcher = StopStringMatcher(["abcd", "c"])
        assert stream(matcher, chunks, "ab") == "ab"
        assert matcher.matched == "c"
    matcher = StopStringMatcher(["bc", "c"], include_stop_str_in_output=True)
    assert matcher.feed("xab") == ("xa", False)
    assert matcher.feed("cd") == ("bc", True)
    assert matcher.matched == "bc"


def test_text_is_released_once_it_cannot_start_a_stop_string() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("x </ans") == ("x ", False)
    assert matcher.feed("wer? no") == ("</answer? no", False)
    assert matcher.feed("<") == ("", False)
    assert matcher.flush() == "<"
    assert not matcher.stopped
    assert StopStringMatcher([]).feed("anything") == ("anything", False)


def test_bad_stop_strings_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"stops\[1\] must be a non-empty str"):
        StopStringMatcher(["a", ""])
    with pytest.raises(TypeError, match="not a single str"):
        StopStringMatcher("abc")


def test_text_buffer_joins_its_pieces_once_and_keeps_growing() -> None:
    from oxibonsai.detokenizer import TextBuffer

    buffer = TextBuffer()
    assert buffer.value() == ""
    pieces = ["a", "", "bc", "\u00e9", "d" * 100]
    for piece in pieces[:3]:
        buffer.append(piece)
    assert buffer.value() == "abc" and buffer.value() == "abc"
    for piece in pieces[3:]:
        buffer.append(piece)
    assert buffer.value() == "".join(pieces)
