"""Tokenizers for the offline packer, and the checks every JSONL record passes before it is encoded.

A packed file stores token ids, so the run that reads it must use the tokenizer that wrote it.
Every tokenizer exposes a :class:`TokenizerIdentity` (a name, a hash of the vocabulary and its
size) that the file records and the reader compares. Identity is the vocabulary's CONTENT: the
same vocabulary under another name or directory is the same tokenizer.

Three kinds: the built-in byte-level one, a local Hugging Face one, and :class:`PreTokenized` for
records that already carry ``input_ids`` (no tokenizer files at all; the identity is what the user
states: a vocabulary size and/or a name).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from nopad.core._errors import check_int, input_error

# Packed files store ids as int32: no id, vocabulary size or pad id may reach 2**31.
MAX_TOKEN_ID = 2**31 - 1
RECORD_KINDS = ("input_ids", "text", "messages")
RECORD_KEYS = (*RECORD_KINDS, "loss_mask")
# A vocabulary of unknown content (pre-tokenized data) records an empty hash and, unless the user
# gives one, this name.
PRE_TOKENIZED = "pre-tokenized"


@dataclass(frozen=True)
class TokenizerIdentity:
    """What a packed file records about the tokenizer that produced its ids.

    ``vocab_hash`` is "" and ``vocab_size`` may be None for pre-tokenized data whose vocabulary
    nopad never saw: only what is known is compared.
    """

    name: str
    vocab_hash: str
    vocab_size: int | None

    @property
    def content_known(self) -> bool:
        return bool(self.vocab_hash)

    def mismatch(self, other: TokenizerIdentity) -> str | None:
        """A sentence naming the first differing fact, or None when the two can be the same tokenizer.

        Vocabulary size and hash decide when both sides know them; the name is only a label then.
        When either side's vocabulary is unknown (pre-tokenized), a size or a name that both state
        must agree.
        """
        mine, theirs = f"{self.vocab_size!r} ({self.name})", f"{other.vocab_size!r} ({other.name})"
        if None not in (self.vocab_size, other.vocab_size) and self.vocab_size != other.vocab_size:
            return f"tokenizer vocab_size: the file was packed with {mine}, this run uses {theirs}"
        if self.content_known and other.content_known:
            if self.vocab_hash != other.vocab_hash:
                mine, theirs = f"{self.vocab_hash[:12]}... ({self.name})", f"{other.vocab_hash[:12]}... ({other.name})"
                return f"tokenizer vocab_hash: the file was packed with {mine}, this run uses {theirs}"
            return None
        if PRE_TOKENIZED not in (self.name, other.name) and self.name != other.name:
            return f"tokenizer name: the file was packed for {self.name!r}, this run uses {other.name!r}"
        return None


def vocab_hash(vocab: Mapping[str, int]) -> str:
    """sha256 of the (token, id) pairs sorted by id: equal vocabularies hash equal on every machine."""
    pairs = sorted(vocab.items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()


class Tokenizer(Protocol):
    identity: TokenizerIdentity
    pad_token_id: int

    @property
    def eos_token_id(self) -> int | None: ...  # None: cannot encode text (pre-tokenized)

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
    """A Hugging Face tokenizer loaded from a LOCAL directory only (never the network).

    Its identity's name is the directory's base name, a label only: a copy of the directory under
    another name has the same vocabulary hash and is the same tokenizer.
    """

    def __init__(self, path: str | os.PathLike[str]):
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise input_error("tokenizer", None, "a local directory holding a saved tokenizer", f"{path!r}")
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as e:  # transformers' own errors for a bad directory
            raise input_error("tokenizer", None, f"a directory with a saved tokenizer in {path!r}", f"{e}") from None
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


class PreTokenized:
    """No tokenizer: records carry ``input_ids`` already, and text cannot be encoded.

    ``vocab_size`` (ids must be below it) and ``name`` are what the user states about the
    vocabulary; neither needs the tokenizer's files. ``pad_token_id`` fills alignment padding.
    """

    eos_token_id = None

    def __init__(self, vocab_size: int | None = None, name: str = PRE_TOKENIZED, pad_token_id: int = 0):
        vocab_size = check_count("vocab_size", vocab_size, 1, MAX_TOKEN_ID + 1, none_ok=True)
        if not isinstance(name, str) or not name.strip():
            raise input_error("tokenizer name", None, "a non-empty string", repr(name))
        top = MAX_TOKEN_ID if vocab_size is None else vocab_size - 1
        pad_token_id = check_count("pad_token_id", pad_token_id, 0, top)  # type: ignore[assignment]
        self.identity = TokenizerIdentity(name, "", vocab_size)
        self.pad_token_id = pad_token_id

    def encode(self, text: str) -> list[int]:
        raise input_error("text", None, "input_ids (pre-tokenized data has no tokenizer to encode text)", "text")


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> ByteTokenizer | HFTokenizer:
    """The built-in byte tokenizer when ``path`` is None, else the local HF tokenizer at ``path``."""
    return ByteTokenizer() if path is None else HFTokenizer(path)


def shown(value: object, width: int = 40) -> str:
    """``value`` as the JSON it came from (null, true, 2.5), cut to ``width`` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def check_count(field: str, value: object, low: int, high: int, *, none_ok: bool = False) -> int | None:
    """``value`` by :func:`nopad.core._errors.check_int` in [low, high] (numpy ints accepted, a bool
    refused); None too when ``none_ok``. Returns it as a Python int."""
    if value is None and none_ok:
        return None
    return check_int(value, field, low=low, high=high)


def encode_record(
    record: Mapping[str, Any], tokenizer: Tokenizer, *, line: int | None = None
) -> tuple[list[int], list[int]]:
    """One JSONL record -> (token ids, loss mask), the mask marking tokens the model must predict.

    Accepted records (exactly one of the three keys; other keys are ignored, except near-misses of
    these, like ``loss_masks``, which are refused as typos):
      {"input_ids": [...], "loss_mask": [...]}   integers in [0, vocab_size); loss_mask optional
                                                (default all ones), 0/1 integers, one per id
      {"text": "..."}                           text + eos, every token predicted
      {"messages": [{"role", "content"}, ...]}  "<|role|>\\n" headers (not predicted), contents
                                                + "\\n" (predicted for the assistant), then eos
    Nothing is coerced: a float, bool, string or null where an id, a 0/1 or a string belongs is
    refused with the record's line and what to fix.
    """
    where = "record" if line is None else f"record line {line}"
    if not isinstance(getattr(tokenizer, "identity", None), TokenizerIdentity):
        expected = "a tokenizer with an identity (load_tokenizer(...), ByteTokenizer() or PreTokenized(...))"
        raise input_error("tokenizer", None, expected, type(tokenizer).__name__)
    kind = record_kind(record, where)
    if kind == "input_ids":
        ids = token_ids(record["input_ids"], tokenizer.identity, where)
        mask = loss_mask(record["loss_mask"], len(ids), where) if "loss_mask" in record else [1] * len(ids)
        return ids, mask
    eos = tokenizer.eos_token_id
    if eos is None:
        expected = "input_ids: pre-tokenized data has no tokenizer (give --tokenizer DIR to encode text)"
        raise input_error(where, None, expected, f"a {kind!r} record")
    if kind == "text":
        text = text_field(record["text"], f"{where}: text")
        ids = tokenizer.encode(text) + [eos]
        return ids, [1] * len(ids)
    return _encode_messages(message_list(record["messages"], where), tokenizer, eos)


def record_kind(record: object, where: str) -> str:
    """Which of input_ids / text / messages ``record`` is; refuses none, several, or a typo'd key."""
    if not isinstance(record, Mapping):
        raise input_error(where, None, "a JSON object", type(record).__name__)
    kinds = [k for k in RECORD_KINDS if k in record]
    if len(kinds) != 1:
        expected = "a key 'input_ids', 'text' or 'messages' (exactly one of them)"
        raise input_error(where, None, expected, f"keys {sorted(map(str, record))}")
    for key in record:
        if (near := _near_miss(str(key))) is not None:
            raise input_error(where, None, f"the key {near!r} (a near-miss is not ignored)", f"{key!r}")
    if "loss_mask" in record and kinds[0] != "input_ids":
        expected = "loss_mask only next to input_ids (text learns every token, messages the assistant's)"
        raise input_error(where, None, expected, f"loss_mask next to {kinds[0]}")
    return kinds[0]


def _normal(key: str) -> str:
    return key.lower().replace("_", "").replace("-", "").replace(" ", "").removesuffix("s")


def _near_miss(key: str) -> str | None:
    """The record key ``key`` nearly spells (case, separators, a plural, one letter off), else None.

    Such a key would otherwise be ignored like any other extra key, and its data lost silently;
    a longer key that merely starts alike (``input_ids_len``) is not a near-miss.
    """
    if key in RECORD_KEYS:
        return None
    for known in RECORD_KEYS:
        one_off = abs(len(key) - len(known)) <= 1 and difflib.SequenceMatcher(None, key, known).ratio() >= 0.8
        if _normal(key) == _normal(known) or one_off:
            return known
    return None


def _int_list(value: object, where: str, field: str) -> list[int]:
    """``value`` as a list of Python ints; anything else (float, bool, str, null, nested) refused."""
    if not isinstance(value, list):
        raise input_error(where, None, f"{field} as a list of integers", shown(value))
    if not set(map(type, value)) <= {int}:  # bool is a subclass of int, so compare types exactly
        k = next(k for k, v in enumerate(value) if type(v) is not int)
        got = f"{shown(value[k])} at {field}[{k}]"
        raise input_error(where, None, f"{field} of integers (nothing is rounded or converted)", got)
    return value


def token_ids(value: object, identity: TokenizerIdentity, where: str) -> list[int]:
    """A record's input_ids: integers in [0, vocab_size) (any below 2**31 when the size is unknown)."""
    ids = _int_list(value, where, "input_ids")
    top = MAX_TOKEN_ID + 1 if identity.vocab_size is None else identity.vocab_size
    if ids and (min(ids) < 0 or max(ids) >= top):
        k = next(k for k, i in enumerate(ids) if not 0 <= i < top)
        hint = "" if identity.vocab_size is not None else " (ids are stored as int32)"
        name = f" for {identity.name}" if identity.vocab_size is not None else ""
        raise input_error(where, None, f"input_ids in [0, {top}){name}{hint}", f"{ids[k]} at input_ids[{k}]")
    return list(ids)


def loss_mask(value: object, n: int, where: str) -> list[int]:
    """A record's loss_mask: n integers, each 0 or 1 (a record without one learns every token)."""
    mask = _int_list(value, where, "loss_mask")
    if len(mask) != n:
        raise input_error(where, None, f"loss_mask of {n} entries like input_ids", f"{len(mask)}")
    if not set(mask) <= {0, 1}:
        k = next(k for k, m in enumerate(mask) if m not in (0, 1))
        raise input_error(where, None, "loss_mask of 0/1", f"{mask[k]} at loss_mask[{k}]")
    return list(mask)


def text_field(value: object, where: str) -> str:
    """A string where text belongs (null, numbers and lists are not turned into their repr)."""
    if not isinstance(value, str):
        raise input_error(where, None, "a string", shown(value))
    return value


def message_list(value: object, where: str) -> list[tuple[str, str]]:
    """``messages`` as (role, content) pairs: a non-empty list of {"role": str, "content": str}."""
    if not isinstance(value, list) or not value:
        raise input_error(where, None, "messages as a non-empty list of {role, content} objects", shown(value))
    pairs = []
    for k, message in enumerate(value):
        at = f"{where}: message {k}"
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise input_error(at, None, "an object with 'role' and 'content'", shown(message, 60))
        role, content = text_field(message["role"], f"{at}: role"), text_field(message["content"], f"{at}: content")
        if not role.strip():
            raise input_error(f"{at}: role", None, "a non-empty role", repr(role))
        # only "assistant" is learned: a role that nearly spells it would silently learn nothing
        if role != "assistant" and difflib.SequenceMatcher(None, role.lower(), "assistant").ratio() >= 0.8:
            raise input_error(
                f"{at}: role", None, "'assistant' (the role that is learned), spelled exactly", repr(role)
            )
        pairs.append((role, content))
    return pairs


def _encode_messages(messages: list[tuple[str, str]], tokenizer: Tokenizer, eos: int) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    mask: list[int] = []
    for role, content in messages:
        head = tokenizer.encode(f"<|{role}|>\n")
        body = tokenizer.encode(f"{content}\n")
        ids += head + body
        mask += [0] * len(head) + [int(role == "assistant")] * len(body)
    ids.append(eos)
    mask.append(int(messages[-1][0] == "assistant"))
    return ids, mask
