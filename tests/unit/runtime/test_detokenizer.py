"""Streaming text must equal the full decode, never split a character, never leak a stop string."""

from __future__ import annotations

import pytest

from lookahead.runtime.detokenizer import Detokenizer
from tests.helpers import ByteTokenizer


def stream(text: str, stop: tuple[str, ...] = (), chunk: int = 1) -> tuple[list[str], Detokenizer]:
    tok = ByteTokenizer()
    detok = Detokenizer(tok, tok.encode("prompt: "), stop)
    ids = tok.encode(text)
    deltas = []
    for i in range(0, len(ids), chunk):
        text, consumed = detok.push(ids[i : i + chunk])
        deltas.append(text)
        if detok.stopped:
            break
    deltas.append(detok.flush())
    return deltas, detok


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_deltas_concatenate_to_the_text_and_never_split_a_character(chunk: int) -> None:
    text = "naïve café — 東京 🚀 done"
    deltas, _ = stream(text, chunk=chunk)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("chunk", [1, 4])
def test_stop_string_is_never_emitted_even_in_part(chunk: int) -> None:
    deltas, detok = stream("Answer: 42\n###\nignored tail", stop=("###",), chunk=chunk)
    assert "".join(deltas) == "Answer: 42\n"
    assert detok.stopped
    assert not any("#" in d for d in deltas)


def test_held_back_prefix_is_released_when_the_stop_string_does_not_complete() -> None:
    deltas, detok = stream("a ## b", stop=("###",))
    assert "".join(deltas) == "a ## b"
    assert not detok.stopped


def test_earliest_of_several_stop_strings_wins() -> None:
    deltas, _ = stream("one END two STOP", stop=("STOP", "END"), chunk=5)
    assert "".join(deltas) == "one "


@pytest.mark.parametrize("include", [False, True])
def test_a_multi_token_push_stops_at_the_token_completing_the_stop_string(include: bool) -> None:
    tok = ByteTokenizer()
    detok = Detokenizer(tok, tok.encode("> "), ("END",), include_stop=include)
    text, consumed = detok.push(tok.encode("ab ENDcd"))
    assert detok.stopped
    assert consumed == len("ab END")  # "c" and "d" are not part of the output
    assert text + detok.flush() == ("ab END" if include else "ab ")


def test_stop_strings_count_only_after_min_tokens() -> None:
    tok = ByteTokenizer()
    detok = Detokenizer(tok, tok.encode("> "), ("x",), min_tokens=3)
    text, consumed = detok.push(tok.encode("axbxc"))
    assert detok.stopped and consumed == 4  # the first "x" is token 2 of 3 the stop string must wait for
    assert text == "axb"


def test_text_before_an_incomplete_character_is_emitted() -> None:
    tok = ByteTokenizer()
    detok = Detokenizer(tok, tok.encode("> "))
    text, _ = detok.push(tok.encode("abc") + tok.encode("é")[:1])
    assert text == "abc"
    text, _ = detok.push(tok.encode("é")[1:])
    assert text == "é"
