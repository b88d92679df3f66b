"""Offline warm-up: pre-fill the global trie from a JSONL corpus before serving.

A trie warmed with the model's own earlier outputs on similar prompts drafts from the first
request on (the reference implementation's published speedups were measured so). One record
per line, either {"text": "..."} (tokenized here, without special tokens, so no BOS lands
inside the n-grams) or {"token_ids": [...]}. Each
record is inserted as its own sequence: no n-gram spans two records.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..algorithm.trie import TOKEN_LIMIT, NGramTrie


def warm_up(
    trie: NGramTrie,
    path: str | os.PathLike[str],
    tokenizer: Any = None,
    *,
    progress: bool = True,
    vocab_size: int = TOKEN_LIMIT,
) -> int:
    """Insert every record of the JSONL file at `path` into `trie`; returns the number of records.

    Blank lines are skipped. A bad line (token ids at or above vocab_size among them: drafts of
    them would index past the model's embeddings) raises ValueError naming the file and the line
    number; records before it stay inserted.
    """
    path = Path(path)
    records = 0
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(
            tqdm(lines, desc=f"warm-up {path.name}", unit=" records", disable=not progress), start=1
        ):
            if line.strip():
                trie.insert(_record_tokens(line, tokenizer, f"{path}:{number}", min(vocab_size, TOKEN_LIMIT)))
                records += 1
    return records


def _record_tokens(line: str, tokenizer: Any, where: str, vocab_size: int) -> list[int]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON ({error.msg})") from None
    if not isinstance(record, dict) or len(record.keys() & {"text", "token_ids"}) != 1:
        raise ValueError(f'{where}: expected an object with either "text" or "token_ids"')
    if "text" in record:
        if not isinstance(record["text"], str):
            raise ValueError(f'{where}: "text" must be a string')
        if tokenizer is None:
            raise ValueError(f'{where}: a "text" record needs a tokenizer')
        ids = list(tokenizer.encode(record["text"], add_special_tokens=False))
    else:
        ids = record["token_ids"]
    if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        raise ValueError(
            f'{where}: "token_ids" must be a list of integers in [0, {vocab_size}) (the vocabulary)'
        )
    return ids
