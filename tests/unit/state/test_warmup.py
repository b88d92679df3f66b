"""warm_up: JSONL records of token ids or text into the global trie, with line-numbered errors."""

from __future__ import annotations

import json

import pytest

from lookahead.algorithm.trie import NO_NODE, NGramTrie
from lookahead.state.warmup import warm_up


class CharTokenizer:
    """A stand-in for a Hugging Face tokenizer: one token per character, optional BOS."""

    bos_token_id = 1

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((text, add_special_tokens))
        return ([self.bos_token_id] if add_special_tokens else []) + [ord(c) for c in text]


def write_jsonl(path, lines: list) -> None:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")


def test_token_id_records_are_inserted_each_as_its_own_sequence(tmp_path):
    corpus = tmp_path / "outputs.jsonl"
    write_jsonl(corpus, [{"token_ids": [5, 6, 7]}, "", {"token_ids": [7, 8]}, "   ", {"token_ids": []}])
    trie = NGramTrie(capacity=1_000, max_depth=4)
    assert warm_up(trie, corpus, progress=False) == 3
    assert trie.count(trie.match([5, 6, 7])) == 1.0
    assert trie.count(trie.match([7])) == 2.0
    assert trie.match([6, 7, 7]) == NO_NODE and trie.match([7, 7]) == NO_NODE  # no n-gram spans two records


def test_text_records_are_tokenized_without_special_tokens(tmp_path):
    corpus = tmp_path / "texts.jsonl"
    write_jsonl(corpus, [{"text": "abab"}, {"text": "héllo"}])
    trie = NGramTrie(capacity=1_000, max_depth=4)
    tokenizer = CharTokenizer()
    assert warm_up(trie, corpus, tokenizer, progress=False) == 2
    assert tokenizer.calls == [("abab", False), ("héllo", False)]
    assert trie.count(trie.match([ord("a"), ord("b")])) == 2.0
    assert trie.match([ord("h"), ord("é")]) != NO_NODE
    assert trie.match([CharTokenizer.bos_token_id]) == NO_NODE


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"token_ids": [1, 2', "not valid JSON"),
        ("[1, 2, 3]", 'expected an object with either "text" or "token_ids"'),
        ('{"text": "a", "token_ids": [1]}', 'expected an object with either "text" or "token_ids"'),
        ('{"tokens": [1]}', 'expected an object with either "text" or "token_ids"'),
        ('{"token_ids": [1, -2]}', '"token_ids" must be a list of integers in [0, 2147483648)'),
        ('{"token_ids": [1, "2"]}', '"token_ids" must be a list of integers'),
        ('{"token_ids": [true]}', '"token_ids" must be a list of integers'),
        ('{"token_ids": "1 2"}', '"token_ids" must be a list of integers'),
        ('{"text": 3}', '"text" must be a string'),
        ('{"text": "needs a tokenizer"}', 'a "text" record needs a tokenizer'),
    ],
)
def test_a_bad_line_raises_naming_the_file_and_line_number(tmp_path, bad_line, message):
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, [{"token_ids": [1, 2, 3]}, "", bad_line])
    trie = NGramTrie(capacity=1_000, max_depth=4)
    with pytest.raises(ValueError) as error:
        warm_up(trie, corpus, progress=False)
    assert str(error.value).startswith(f"{corpus}:3: ")
    assert message in str(error.value)
    assert trie.match([1, 2, 3]) != NO_NODE  # records before the bad line stay inserted


def test_progress_bar_reports_records(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl(corpus, [{"token_ids": [1, 2]}] * 3)
    assert warm_up(NGramTrie(capacity=1_000, max_depth=4), corpus) == 3
    assert "warm-up corpus.jsonl" in capsys.readouterr().err
    assert warm_up(NGramTrie(capacity=1_000, max_depth=4), corpus, progress=False) == 3
    assert capsys.readouterr().err == ""


def test_warm_up_respects_the_trie_capacity(tmp_path):
    corpus = tmp_path / "big.jsonl"
    write_jsonl(corpus, [{"token_ids": list(range(i * 100, i * 100 + 100))} for i in range(50)])
    trie = NGramTrie(capacity=500, max_depth=4)
    assert warm_up(trie, corpus, progress=False) == 50
    assert 0 < trie.node_count <= 500


def test_token_ids_outside_the_vocabulary_are_refused_and_never_reach_the_trie(tmp_path):
    path = tmp_path / "corpus.jsonl"
    write_jsonl(path, [{"token_ids": [1, 2, 3, 4]}, {"token_ids": [5, 6, 300, 7]}])
    trie = NGramTrie(capacity=1000, max_depth=4)
    with pytest.raises(ValueError, match=r"corpus.jsonl:2: .*\[0, 256\)"):
        warm_up(trie, path, vocab_size=256, progress=False)
    assert trie.match([5, 6]) == NO_NODE
