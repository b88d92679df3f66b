"""ChatGLM3's tokenizer from its tokenizer.model alone, without its tokenization_chatglm.py.

ChatGLM3's tokenizer is a SentencePiece model plus nine special tokens numbered from the end
of the SentencePiece vocabulary, in this order: [MASK] [gMASK] [sMASK] sop eop <|system|>
<|user|> <|assistant|> <|observation|>. Text is encoded by SentencePiece as it is (special
tokens written in the text stay text); every encoded prompt starts with [gMASK] sop; a chat turn
is <|role|>, then "{metadata}\\n" and the message, each encoded on its own; the reply follows
<|assistant|> and ends where the model starts the next role (<|user|>, <|observation|>) or at
EOS. Special tokens decode to their names unless skipped.

This class offers what the project calls on a tokenizer (encode, __call__, decode,
apply_chat_template, eos/pad ids, len), not the whole transformers tokenizer interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = (
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "sop",
    "eop",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
)
ROLES = ("system", "user", "assistant", "observation")
TOKENIZER_FILE = "tokenizer.model"
# What apply_chat_template builds, for readers (the layout is code, not a Jinja template).
CHAT_FORMAT = "[gMASK]sop<|{role}|>{metadata}\\n{content}...<|assistant|>"


@dataclass(frozen=True)
class Encoding:
    input_ids: list[int]


class ChatGLM3Tokenizer:
    """SentencePiece ids for text, ChatGLM3's special tokens after them."""

    chat_template = CHAT_FORMAT

    def __init__(self, model_file: Path):
        from sentencepiece import SentencePieceProcessor

        self.sp = SentencePieceProcessor(model_file=str(model_file))
        base = self.sp.vocab_size()
        self.special_ids = {token: base + index for index, token in enumerate(SPECIAL_TOKENS)}
        self.special_tokens = {index: token for token, index in self.special_ids.items()}
        self.eos_token_id = self.sp.eos_id()
        self.pad_token_id = self.sp.unk_id()
        self.prefix_ids = [self.special_ids["[gMASK]"], self.special_ids["sop"]]

    @property
    def end_token_ids(self) -> tuple[int, ...]:
        """EOS and the role tokens a reply ends at."""
        return (self.eos_token_id, self.special_ids["<|user|>"], self.special_ids["<|observation|>"])

    def __len__(self) -> int:
        return self.sp.vocab_size() + len(SPECIAL_TOKENS)

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        ids = list(self.sp.encode(text))
        return self.prefix_ids + ids if add_special_tokens else ids

    def __call__(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> Encoding:
        return Encoding(self.encode(text, add_special_tokens))

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.special_ids[token] if token in self.special_ids else self.sp.piece_to_id(token)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        """Text of `ids`; ids past the vocabulary (the model's padding rows) decode to nothing."""
        text, run = [], []
        for token in map(int, ids):
            if token in self.special_tokens:
                text.append(self.sp.decode(run))
                run = []
                if not skip_special_tokens:
                    text.append(self.special_tokens[token])
            elif 0 <= token < self.sp.vocab_size():
                run.append(token)
        text.append(self.sp.decode(run))
        return "".join(text)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of a conversation in ChatGLM3's chat layout (no return_dict form)."""
        if return_dict:
            raise ValueError("ChatGLM3Tokenizer.apply_chat_template returns token ids only")
        ids = list(self.prefix_ids)
        for message in messages:
            role = message["role"]
            if role not in ROLES:
                raise ValueError(f"ChatGLM3 roles are {', '.join(ROLES)}, not {role!r}")
            ids.append(self.special_ids[f"<|{role}|>"])
            ids += self.sp.encode(f"{message.get('metadata', '')}\n")
            ids += self.sp.encode(message["content"])
        if add_generation_prompt:
            ids.append(self.special_ids["<|assistant|>"])
        return ids


def load_chatglm_tokenizer(folder: Path) -> ChatGLM3Tokenizer | None:
    """The tokenizer of a ChatGLM folder holding tokenizer.model, else None (token ids only)."""
    path = folder / TOKENIZER_FILE
    return ChatGLM3Tokenizer(path) if path.is_file() else None
