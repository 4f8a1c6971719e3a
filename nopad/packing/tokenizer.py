"""Tokenizers for the offline packer: a built-in byte-level one and a local Hugging Face one.

A packed file stores token ids, so the run that reads it must use the tokenizer that wrote it.
Both tokenizers expose a :class:`TokenizerIdentity` (a name and a hash of the vocabulary) that the
file records and the reader compares.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from nopad.errors import input_error


@dataclass(frozen=True)
class TokenizerIdentity:
    """What a packed file records about the tokenizer that produced its ids."""

    name: str
    vocab_hash: str
    vocab_size: int

    def mismatch(self, other: TokenizerIdentity) -> str | None:
        """A sentence naming the first differing field, or None when the two are the same tokenizer."""
        for field in ("name", "vocab_size", "vocab_hash"):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                return f"tokenizer {field}: the file was packed with {mine!r}, this run uses {theirs!r}"
        return None


def vocab_hash(vocab: Mapping[str, int]) -> str:
    """sha256 of the (token, id) pairs sorted by id: equal vocabularies hash equal on every machine."""
    pairs = sorted(vocab.items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()


class Tokenizer(Protocol):
    identity: TokenizerIdentity
    pad_token_id: int
    eos_token_id: int

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then <pad> = 256 and <eos> = 257. Needs no files, never changes."""

    name = "nopad-byte-v1"
    pad_token_id = 256
    eos_token_id = 257

    def __init__(self) -> None:
        vocab = {f"<0x{b:02X}>": b for b in range(256)}
        vocab.update({"<pad>": self.pad_token_id, "<eos>": self.eos_token_id})
        self.identity = TokenizerIdentity(self.name, vocab_hash(vocab), len(vocab))

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a LOCAL directory only (never the network)."""

    def __init__(self, path: str | os.PathLike[str]):
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise input_error("tokenizer", None, "a local directory holding a saved tokenizer", f"{path!r}")
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        vocab = self._tok.get_vocab()
        self.eos_token_id = self._tok.eos_token_id
        if self.eos_token_id is None:
            raise input_error(f"tokenizer {path!r}", None, "an eos token to end each conversation", "none")
        pad = self._tok.pad_token_id
        self.pad_token_id = self.eos_token_id if pad is None else pad
        name = os.path.basename(os.path.normpath(path))
        self.identity = TokenizerIdentity(name, vocab_hash(vocab), len(vocab))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids))


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> ByteTokenizer | HFTokenizer:
    """The built-in byte tokenizer when ``path`` is None, else the local HF tokenizer at ``path``."""
    return ByteTokenizer() if path is None else HFTokenizer(path)


def encode_record(
    record: Mapping[str, Any], tokenizer: Tokenizer, *, line: int | None = None
) -> tuple[list[int], list[int]]:
    """One JSONL record -> (token ids, loss mask), the mask marking tokens the model must predict.

    Accepted records:
      {"input_ids": [...], "loss_mask": [...]}   loss_mask optional, default all ones
      {"text": "..."}                           text + eos, every token predicted
      {"messages": [{"role", "content"}, ...]}  "<|role|>\\n" headers (not predicted), contents
                                                + "\\n" (predicted for the assistant), then eos
    """
    where = "record" if line is None else f"record line {line}"
    if "input_ids" in record:
        ids = [int(i) for i in record["input_ids"]]
        mask = [int(m) for m in record.get("loss_mask", [1] * len(ids))]
        if len(mask) != len(ids):
            raise input_error(f"{where}", None, f"loss_mask of {len(ids)} entries like input_ids", f"{len(mask)}")
        vocab = tokenizer.identity.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise input_error(f"{where}", None, f"input_ids in [0, {vocab}) for {tokenizer.identity.name}", f"{bad[0]}")
        if any(m not in (0, 1) for m in mask):
            raise input_error(f"{where}", None, "loss_mask of 0/1", f"{sorted(set(mask))}")
        return ids, mask
    if "text" in record:
        ids = tokenizer.encode(str(record["text"])) + [tokenizer.eos_token_id]
        return ids, [1] * len(ids)
    if "messages" in record:
        ids, mask = [], []
        last_role = None
        for k, message in enumerate(record["messages"]):
            if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
                raise input_error(f"{where}: message {k}", None, "an object with 'role' and 'content'", f"{message!r}")
            head = tokenizer.encode(f"<|{message['role']}|>\n")
            body = tokenizer.encode(f"{message['content']}\n")
            last_role = message["role"]
            ids += head + body
            mask += [0] * len(head) + [int(last_role == "assistant")] * len(body)
        ids.append(tokenizer.eos_token_id)
        mask.append(int(last_role == "assistant"))
        return ids, mask
    raise input_error(f"{where}", None, "a key 'input_ids', 'text' or 'messages'", f"keys {sorted(record)}")
