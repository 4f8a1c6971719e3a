"""Bad input to the packer, packed files and the CLI: a catalogue of cases, each refused with the
words that say what to fix, near-valid inputs generated one field off, and valid edge inputs that
must keep giving exact results.

Kinds: records (encode_record and `nopad pack`), JSONL lines, pre-tokenized data, packed-file
metadata, packed-file schema and bytes (a byte-flip sweep), tokenizer identity, pack_online,
collate_packed, write_packed, CLI arguments of every subcommand.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# private: a file's metadata is rewritten with a recomputed checksum, as a forger would
from nopad._apps.cli import main
from nopad.packing import (
    ByteTokenizer,
    PreTokenized,
    TokenizerIdentity,
    check_packed,
    collate_packed,
    encode_record,
    load_tokenizer,
    pack_conversations,
    pack_online,
    read_packed,
    write_packed,
)
from nopad.packing._files import METADATA_KEY, metadata_checksum, read_metadata

ROOT = Path(__file__).resolve().parents[1]
BYTES = ByteTokenizer()
NO_TRACEBACK = "Traceback"


# ---- helpers -----------------------------------------------------------------------------------
def cli(*argv: str) -> tuple[int, str, str]:
    """Run `nopad ARGV` in this process: (exit status, stdout, stderr); argparse's exit included."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as e:
            rc = int(e.code or 0)
    return rc, out.getvalue(), err.getvalue()


def jsonl(tmp_path: Path, lines: list[str] | bytes, name: str = "in.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(lines if isinstance(lines, bytes) else "".join(line + "\n" for line in lines).encode())
    return path


def pack_cli(tmp_path: Path, src: Path, *args: str, pack_length: int = 16) -> tuple[int, str, str]:
    out = tmp_path / "out.parquet"
    return cli("pack", str(src), "-o", str(out), "--pack-length", str(pack_length), "--no-progress", *args)


def assert_refused(rc: int, err: str, match: str, status: int = 2) -> None:
    assert rc == status, err
    assert NO_TRACEBACK not in err
    assert re.search(match, err), err


def small_file(tmp_path: Path, name: str = "small.parquet") -> Path:
    """Three conversations, alignment 2, pack length 8, the byte tokenizer."""
    rows, _ = pack_conversations(
        [([1, 2, 3], [0, 1, 1]), ([4, 5, 6, 7, 8], [1] * 5), ([9, 10], [1, 1])], 8, alignment=2, pad_token_id=256
    )
    path = tmp_path / name
    write_packed(path, rows, pack_length=8, tokenizer=BYTES.identity, pad_token_id=256, alignment=2)
    return path


def set_raw_metadata(path: Path, raw: bytes | None) -> None:
    """Rewrite ``path`` with the same rows and ``raw`` as its nopad metadata (None: no metadata)."""
    table = pq.read_table(path)
    meta = {} if raw is None else {METADATA_KEY: raw}
    pq.write_table(table.replace_schema_metadata(meta), path)


def edit_metadata(path: Path, edit) -> None:
    meta = read_metadata(path)
    edit(meta)
    set_raw_metadata(path, json.dumps(meta).encode())


def rows_of(packed) -> list[dict[str, list[int]]]:
    return [{f: v.tolist() for f, v in packed[i].items()} for i in range(len(packed))]


def segments(packed) -> list[list[int]]:
    """Every conversation segment of the file's rows, in order."""
    out = []
    for i in range(len(packed)):
        row = packed[i]
        cu = row["packed_cu_seqlens"].tolist()
        out += [row["input_ids"][a:b].tolist() for a, b in zip(cu[:-1], cu[1:])]
    return out


# ---- records: encode_record and `nopad pack` ---------------------------------------------------
BAD_RECORDS = [
    ("float id", {"input_ids": [1, 2.5, 3]}, r"expected input_ids of integers .*got 2\.5 at input_ids\[1\]"),
    ("integral float id", {"input_ids": [1, 2.0]}, r"expected input_ids of integers .*got 2\.0 at input_ids\[1\]"),
    ("bool id", {"input_ids": [True, 2]}, r"expected input_ids of integers .*got true at input_ids\[0\]"),
    ("nested id", {"input_ids": [[1, 2], 3]}, r"expected input_ids of integers .*got \[1, 2\] at input_ids\[0\]"),
    ("string id", {"input_ids": [1, "2"]}, r"expected input_ids of integers .*got \"2\" at input_ids\[1\]"),
    ("null id", {"input_ids": [None]}, r"expected input_ids of integers .*got null at input_ids\[0\]"),
    (
        "negative id",
        {"input_ids": [1, -4]},
        r"expected input_ids in \[0, 258\) for nopad-byte-v1, got -4 at input_ids\[1\]",
    ),
    ("id past the vocabulary", {"input_ids": [258]}, r"expected input_ids in \[0, 258\) for nopad-byte-v1, got 258"),
    ("ids a string", {"input_ids": "1 2 3"}, r"expected input_ids as a list of integers, got \"1 2 3\""),
    ("ids null", {"input_ids": None}, r"expected input_ids as a list of integers, got null"),
    ("ids an object", {"input_ids": {"0": 1}}, r"expected input_ids as a list of integers"),
    ("mask 0.5", {"input_ids": [1, 2], "loss_mask": [1, 0.5]}, r"expected loss_mask of integers .*got 0\.5"),
    ("mask 2", {"input_ids": [1, 2], "loss_mask": [1, 2]}, r"expected loss_mask of 0/1, got 2 at loss_mask\[1\]"),
    ("mask -1", {"input_ids": [1, 2], "loss_mask": [-1, 0]}, r"expected loss_mask of 0/1, got -1 at loss_mask\[0\]"),
    ("mask bool", {"input_ids": [1, 2], "loss_mask": [True, False]}, r"loss_mask of integers .*got true"),
    ("mask string", {"input_ids": [1], "loss_mask": ["1"]}, r"loss_mask of integers .*got \"1\""),
    (
        "mask short",
        {"input_ids": [1, 2, 3], "loss_mask": [1, 1]},
        r"expected loss_mask of 3 entries like input_ids, got 2",
    ),
    ("mask null", {"input_ids": [1, 2], "loss_mask": None}, r"expected loss_mask as a list of integers, got null"),
    ("mask next to text", {"text": "a", "loss_mask": [1]}, r"expected loss_mask only next to input_ids"),
    ("text null", {"text": None}, r"text: expected a string, got null"),
    ("text number", {"text": 5}, r"text: expected a string, got 5"),
    ("text list", {"text": ["a"]}, r"text: expected a string, got \[\"a\"\]"),
    ("messages empty", {"messages": []}, r"expected messages as a non-empty list"),
    ("messages a string", {"messages": "hi"}, r"expected messages as a non-empty list .*got \"hi\""),
    ("message a string", {"messages": ["hi"]}, r"message 0: expected an object with 'role' and 'content'"),
    ("message without content", {"messages": [{"role": "user"}]}, r"message 0: expected an object with 'role'"),
    (
        "content null",
        {"messages": [{"role": "user", "content": None}]},
        r"message 0: content: expected a string, got null",
    ),
    ("role number", {"messages": [{"role": 1, "content": "a"}]}, r"message 0: role: expected a string, got 1"),
    ("role empty", {"messages": [{"role": " ", "content": "a"}]}, r"message 0: role: expected a non-empty role"),
    ("role Assistant", {"messages": [{"role": "Assistant", "content": "a"}]}, r"role: expected 'assistant' .*spelled"),
    ("role assitant", {"messages": [{"role": "assitant", "content": "a"}]}, r"role: expected 'assistant'"),
    ("no known key", {"prompt": "x"}, r"expected a key 'input_ids', 'text' or 'messages' .*got keys \['prompt'\]"),
    ("two kinds", {"text": "a", "messages": []}, r"exactly one of them\), got keys \['messages', 'text'\]"),
    ("typo of loss_mask", {"input_ids": [1], "loss_masks": [0]}, r"expected the key 'loss_mask' .*got 'loss_masks'"),
    ("typo of messages", {"text": "a", "message": "b"}, r"expected the key 'messages' .*got 'message'"),
    ("one letter off loss_mask", {"input_ids": [1], "loss_mak": [0]}, r"expected the key 'loss_mask' .*got 'loss_mak'"),
    ("input ids in camel case", {"text": "a", "inputIds": [1]}, r"expected the key 'input_ids' .*got 'inputIds'"),
]


@pytest.mark.parametrize(("record", "match"), [pytest.param(r, m, id=i) for i, r, m in BAD_RECORDS])
def test_a_bad_record_is_refused_naming_its_line(record, match):
    before = copy.deepcopy(record)
    with pytest.raises(ValueError, match=r"^record line 5: .*" + match):
        encode_record(record, BYTES, line=5)
    assert record == before  # nothing mutated


@pytest.mark.parametrize(("record", "match"), [pytest.param(r, m, id=i) for i, r, m in BAD_RECORDS])
def test_nopad_pack_refuses_a_bad_record_with_file_and_line(tmp_path, record, match):
    src = jsonl(tmp_path, [json.dumps({"text": "fine"}), json.dumps(record)])
    rc, _, err = pack_cli(tmp_path, src, "--tokenizer", "bytes")
    assert_refused(rc, err, rf"nopad pack: error: {re.escape(str(src))}: record line 2: .*" + match)
    assert not (tmp_path / "out.parquet").exists()  # nothing written


# ---- JSONL lines ---------------------------------------------------------------------------------
BAD_LINES = [
    ("blank line", b'{"text": "a"}\n\n{"text": "b"}\n', r"record line 2: expected a JSON object .*got a blank line"),
    ("blank line at the end", b'{"text": "a"}\n\n', r"record line 2: .*delete the blank line"),
    ("whitespace line", b'{"text": "a"}\n  \t\n', r"record line 2: .*got a blank line"),
    (
        "invalid JSON",
        b'{"text": "a"}\nnot json\n',
        r"record line 2: expected a JSON object, got invalid JSON \(Expecting value",
    ),
    ("truncated JSON", b'{"text": "a"\n', r"record line 1: expected a JSON object, got invalid JSON"),
    ("array line", b"[1, 2]\n", r"record line 1: expected a JSON object, got list"),
    ("string line", b'"text"\n', r"record line 1: expected a JSON object, got str"),
    ("number line", b"3\n", r"record line 1: expected a JSON object, got int"),
    ("null line", b"null\n", r"record line 1: expected a JSON object, got NoneType"),
    (
        "NaN",
        b'{"input_ids": [NaN]}\n',
        r"record line 1: number: expected a JSON number \(NaN and Infinity are not JSON\), got NaN",
    ),
    ("Infinity", b'{"input_ids": [1], "loss_mask": [Infinity]}\n', r"record line 1: .*got Infinity"),
    (
        "duplicate key",
        b'{"text": "a", "text": "b"}\n',
        r"record line 1: key: expected each key once per object, got 'text' twice",
    ),
    (
        "duplicate key in a message",
        b'{"messages": [{"role": "user", "role": "assistant", "content": "a"}]}\n',
        r"record line 1: key: .*'role' twice",
    ),
    (
        "bad UTF-8",
        b'{"text": "a"}\n{"text": "\xff"}\n',
        r"record line 2: expected UTF-8 text, got the byte 0xff at column 11",
    ),
    ("empty file", b"", r"records: expected at least one JSON record, got an empty file"),
]


@pytest.mark.parametrize(("content", "match"), [pytest.param(c, m, id=i) for i, c, m in BAD_LINES])
def test_nopad_pack_refuses_a_bad_jsonl_line(tmp_path, content, match):
    src = jsonl(tmp_path, content)
    rc, _, err = pack_cli(tmp_path, src)
    assert_refused(rc, err, rf"{re.escape(str(src))}: " + match)


def test_text_next_to_ids_the_byte_tokenizer_lacks_names_both_lines(tmp_path):
    src = jsonl(tmp_path, ['{"input_ids": [1, 2]}', '{"input_ids": [300, 2]}', '{"text": "hi"}'])
    rc, _, err = pack_cli(tmp_path, src)
    expected = r"record line 2: expected input_ids in \[0, 258\) for nopad-byte-v1, the tokenizer of the text on line 3"
    assert_refused(rc, err, expected + r" \(give --tokenizer DIR .*\), got 300")


def test_a_pack_where_every_conversation_is_rejected_writes_nothing(tmp_path):
    src = jsonl(tmp_path, ['{"input_ids": [1, 2, 3, 4, 5]}', '{"input_ids": []}'])
    rc, _, err = pack_cli(tmp_path, src, "--overflow", "reject", pack_length=4)
    expected = r"rows: expected at least one row to write; raise --pack-length or use --overflow split, got every"
    assert_refused(rc, err, expected + r" conversation rejected \(1 too long, 1 empty\)")
    assert not (tmp_path / "out.parquet").exists()


# ---- pre-tokenized data ------------------------------------------------------------------------
def test_pre_tokenized_ids_of_a_real_vocabulary_pack_without_any_tokenizer(tmp_path):
    records = [[300, 4000, 31999], [5, 6], [128000, 1]]
    src = jsonl(tmp_path, [json.dumps({"input_ids": r}) for r in records])
    rc, out, err = pack_cli(tmp_path, src)
    assert rc == 0, err
    assert "tokenizer pre-tokenized (vocabulary size unknown, largest id 128000)" in out
    packed = read_packed(tmp_path / "out.parquet")
    assert packed.metadata["tokenizer"] == {"name": "pre-tokenized", "vocab_hash": "", "vocab_size": None}
    assert packed.metadata["max_token_id"] == 128000 and packed.metadata["pad_token_id"] == 0
    assert segments(packed) == records


def test_pre_tokenized_with_a_stated_vocabulary_records_it_and_refuses_ids_past_it(tmp_path):
    src = jsonl(tmp_path, ['{"input_ids": [31999, 0]}'])
    rc, out, err = pack_cli(tmp_path, src, "--vocab-size", "32000", "--tokenizer-name", "llama", "--pad-token-id", "7")
    assert rc == 0, err
    meta = read_packed(tmp_path / "out.parquet").metadata
    assert meta["tokenizer"] == {"name": "llama", "vocab_hash": "", "vocab_size": 32000} and meta["pad_token_id"] == 7
    src = jsonl(tmp_path, ['{"input_ids": [1]}', '{"input_ids": [31999, 32000]}'], "wide.jsonl")
    rc, _, err = pack_cli(tmp_path, src, "--vocab-size", "32000")
    assert_refused(
        rc, err, r"wide.jsonl: record line 2: expected input_ids in \[0, 32000\) for pre-tokenized, got 32000"
    )


BAD_PRE_TOKENIZED = [
    (
        "text without a tokenizer",
        ['{"text": "a"}'],
        ["--vocab-size", "100"],
        r"record line 1: expected input_ids: pre-tokenized data has no tokenizer .*got a 'text' record",
    ),
    (
        "messages without a tokenizer",
        ['{"messages": [{"role": "user", "content": "a"}]}'],
        ["--tokenizer-name", "x"],
        r"record line 1: .*got a 'messages' record",
    ),
    (
        "an id at int32's limit",
        ['{"input_ids": [2147483648]}'],
        [],
        r"record line 1: expected input_ids in \[0, 2147483648\) \(ids are stored as int32\)",
    ),
    (
        "a pad id past the vocabulary",
        ['{"input_ids": [1]}'],
        ["--vocab-size", "10", "--pad-token-id", "10"],
        r"--pad-token-id: expected an int in \[0, 9\], got 10",
    ),
    (
        "a pad id past the bytes",
        ['{"text": "a"}'],
        ["--pad-token-id", "258"],
        r"--pad-token-id: expected an int in \[0, 257\], got 258",
    ),
    (
        "a tokenizer and a vocabulary size",
        ['{"input_ids": [1]}'],
        ["--tokenizer", "bytes", "--vocab-size", "10"],
        r"--vocab-size: expected --tokenizer, or --vocab-size/--tokenizer-name .* not both",
    ),
    (
        "a tokenizer and a name",
        ['{"input_ids": [1]}'],
        ["--tokenizer", "bytes", "--tokenizer-name", "x"],
        r"--tokenizer-name: expected .* not both",
    ),
]


@pytest.mark.parametrize(("lines", "args", "match"), [pytest.param(x, a, m, id=i) for i, x, a, m in BAD_PRE_TOKENIZED])
def test_pre_tokenized_misuse_is_refused(tmp_path, lines, args, match):
    rc, _, err = pack_cli(tmp_path, jsonl(tmp_path, lines), *args)
    assert_refused(rc, err, match)


def test_a_pre_tokenized_file_is_read_against_the_run_s_vocabulary(tmp_path):
    src = jsonl(tmp_path, ['{"input_ids": [300, 2]}'])
    assert pack_cli(tmp_path, src)[0] == 0
    path = tmp_path / "out.parquet"
    with pytest.raises(ValueError, match=r"input_ids row 0: expected token ids in \[0, 258\)"):
        read_packed(path, tokenizer=BYTES.identity)  # unknown vocabulary: the ids must fit the run's
    assert read_packed(path, tokenizer=TokenizerIdentity("llama", "ab" * 32, 32000)).metadata["max_token_id"] == 300
    named = PreTokenized(32000, "llama").identity
    assert read_packed(path, tokenizer=named).metadata["tokenizer"]["name"] == "pre-tokenized"


def test_stated_pre_tokenized_facts_must_agree_with_the_run(tmp_path):
    src = jsonl(tmp_path, ['{"input_ids": [300, 2]}'])
    assert pack_cli(tmp_path, src, "--vocab-size", "32000", "--tokenizer-name", "llama")[0] == 0
    path = tmp_path / "out.parquet"
    with pytest.raises(ValueError, match=r"another tokenizer: tokenizer vocab_size: the file was packed with 32000"):
        read_packed(path, tokenizer=TokenizerIdentity("llama", "ab" * 32, 50000))
    with pytest.raises(ValueError, match=r"another tokenizer: tokenizer name: the file was packed for 'llama'"):
        read_packed(path, tokenizer=PreTokenized(name="mistral").identity)
    assert len(read_packed(path, tokenizer=TokenizerIdentity("llama", "ab" * 32, 32000))) == 1


# ---- tokenizer identity: content, not a name -----------------------------------------------------
def save_word_tokenizer(directory: Path, words: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(directory)


def test_a_copy_of_a_tokenizer_directory_under_another_name_is_the_same_tokenizer(tmp_path):
    save_word_tokenizer(tmp_path / "tok-a", ["hello", "world"])
    shutil.copytree(tmp_path / "tok-a", tmp_path / "renamed-copy")
    save_word_tokenizer(tmp_path / "tok-b", ["hello", "there"])  # same size, other vocabulary
    src = jsonl(tmp_path, ['{"text": "hello world"}'])
    assert pack_cli(tmp_path, src, "--tokenizer", str(tmp_path / "tok-a"))[0] == 0
    path = tmp_path / "out.parquet"
    copy_identity = load_tokenizer(tmp_path / "renamed-copy").identity
    assert copy_identity.name == "renamed-copy"
    assert read_packed(path, tokenizer=copy_identity)[0]["input_ids"].tolist() == [3, 4, 1]
    assert cli("inspect", str(path), "--tokenizer", str(tmp_path / "renamed-copy"))[0] == 0
    with pytest.raises(
        ValueError, match=r"another tokenizer: tokenizer vocab_hash: the file was packed with \w+\.\.\. \(tok-a\)"
    ):
        read_packed(path, tokenizer=load_tokenizer(tmp_path / "tok-b").identity)


def test_a_directory_that_holds_no_tokenizer_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    src = jsonl(tmp_path, ['{"text": "a"}'])
    rc, _, err = pack_cli(tmp_path, src, "--tokenizer", str(tmp_path / "empty"))
    assert_refused(rc, err, r"tokenizer: expected a directory with a saved tokenizer in")
    rc, _, err = pack_cli(tmp_path, src, "--tokenizer", str(tmp_path / "missing"))
    assert_refused(rc, err, r"tokenizer: expected a local directory holding a saved tokenizer")


# ---- packed-file metadata ------------------------------------------------------------------------
def _set(key, value):
    return lambda m: m.__setitem__(key, value)


def _set_tok(key, value):
    return lambda m: m["tokenizer"].__setitem__(key, value)


CHECKSUM = r"metadata_checksum: expected the checksum of the metadata as written, got metadata edited since"
BAD_METADATA = [
    ("alignment 0", _set("alignment", 0), r"metadata alignment: expected an integer in \[1, 2147483647\], got 0"),
    ("alignment 1, in range", _set("alignment", 1), CHECKSUM),
    ("alignment a string", _set("alignment", "2"), r"metadata alignment: expected an integer .*got '2'"),
    ("alignment a bool", _set("alignment", True), r"metadata alignment: expected an integer .*got True"),
    ("alignment not dividing", _set("alignment", 3), r"metadata alignment: expected a divisor of pack_length 8, got 3"),
    (
        "pad id past the vocabulary",
        _set("pad_token_id", 999),
        r"metadata pad_token_id: expected a token id in \[0, 257\], got 999",
    ),
    ("pad id negative", _set("pad_token_id", -1), r"metadata pad_token_id: expected a token id in \[0, 257\], got -1"),
    ("pad id 0, in range", _set("pad_token_id", 0), CHECKSUM),
    ("pack_length 16, in range", _set("pack_length", 16), CHECKSUM),
    ("pack_length 0", _set("pack_length", 0), r"metadata pack_length: expected an integer in \[1, 2147483647\], got 0"),
    ("pack_length a float", _set("pack_length", 7.5), r"metadata pack_length: expected an integer .*got 7\.5"),
    ("pack_length past int32", _set("pack_length", 2**31), r"metadata pack_length: .*got 2147483648"),
    ("cp_size 2, in range", _set("cp_size", 2), CHECKSUM),
    ("cp_size 4", _set("cp_size", 4), r"metadata alignment: expected a multiple of tp_size \* cp_size = 4, got 2"),
    ("cp_size 0", _set("cp_size", 0), r"metadata cp_size: expected an integer in \[1, .*got 0"),
    ("tp_size a bool", _set("tp_size", True), r"metadata tp_size: expected an integer .*got True"),
    ("num_rows 99", _set("num_rows", 99), r"num_rows: expected 99 as recorded, got 2"),
    ("num_rows -1", _set("num_rows", -1), r"metadata num_rows: expected an integer in \[0, .*got -1"),
    ("tokenizer name empty", _set_tok("name", ""), r"metadata tokenizer name: expected a non-empty string"),
    ("tokenizer name other, a label", _set_tok("name", "other"), CHECKSUM),
    (
        "vocab_size 100",
        _set_tok("vocab_size", 100),
        r"metadata pad_token_id: expected a token id in \[0, 99\], got 256",
    ),
    (
        "vocab_size null with a hash",
        _set_tok("vocab_size", None),
        r"metadata tokenizer vocab_size: expected an integer",
    ),
    ("vocab_hash not hex", _set_tok("vocab_hash", "xyz"), r"metadata tokenizer vocab_hash: expected 64 lowercase hex"),
    (
        "tokenizer without a key",
        lambda m: m["tokenizer"].pop("vocab_size"),
        r"metadata tokenizer: expected an object with exactly the keys",
    ),
    ("tokenizer a string", _set("tokenizer", "bytes"), r"metadata tokenizer: expected an object"),
    ("an unknown key", _set("extra", 1), r"metadata keys: expected only the keys of format 2, got unknown \['extra'\]"),
    (
        "a missing key",
        lambda m: m.pop("pad_token_id"),
        r"metadata keys: expected every key of format 2, got missing \['pad_token_id'\]",
    ),
    (
        "format 3",
        _set("format_version", 3),
        r"metadata format_version: expected one of \[1, 2\] \(a newer nopad wrote this file: upgrade nopad\), got 3",
    ),
    ("format a string", _set("format_version", "2"), r"metadata format_version: expected one of \[1, 2\], got '2'"),
    ("format 1 with format 2 keys", _set("format_version", 1), r"unknown \['max_token_id', 'metadata_checksum'\]"),
    (
        "rows checksum of other rows",
        _set("rows_checksum", "0" * 64),
        r"rows_checksum: expected the checksum recorded when the file was written",
    ),
    ("rows checksum not hex", _set("rows_checksum", "zz"), r"metadata rows_checksum: expected 64 lowercase hex digits"),
    ("metadata checksum removed", lambda m: m.pop("metadata_checksum"), r"missing \['metadata_checksum'\]"),
    ("metadata checksum other", _set("metadata_checksum", "f" * 64), CHECKSUM),
    ("report edited", lambda m: m["report"].__setitem__("utilisation", 1.0), CHECKSUM),
    ("report a list", _set("report", []), r"metadata report: expected an object, got \[\]"),
    (
        "max_token_id past the vocabulary",
        _set("max_token_id", 300),
        r"metadata max_token_id: expected a token id in \[0, 257\]",
    ),
    ("max_token_id other", _set("max_token_id", 5), r"max_token_id: expected 5 as recorded, got 256 in the rows"),
]

BAD_RAW_METADATA = [
    ("NaN", b'{"format_version": NaN}', r"metadata: expected JSON numbers \(NaN and Infinity are not JSON\), got NaN"),
    ("invalid JSON", b'{"format_version": 2', r"metadata: expected UTF-8 JSON, got JSONDecodeError"),
    ("not UTF-8", b'{"a": "\xff"}', r"metadata: expected UTF-8 JSON, got UnicodeDecodeError"),
    ("a list", b"[]", r"metadata: expected a JSON object, got list"),
    (
        "absent",
        None,
        r"metadata: expected nopad packed-file metadata \(nopad.packed\); write it with nopad pack, got none",
    ),
]


@pytest.mark.parametrize(("edit", "match"), [pytest.param(e, m, id=i) for i, e, m in BAD_METADATA])
def test_an_edited_metadata_key_is_refused_by_read_packed_and_inspect(tmp_path, edit, match):
    path = small_file(tmp_path)
    edit_metadata(path, edit)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: (.|\n)*" + match):
        read_packed(path)
    rc, out, err = cli("inspect", str(path))
    assert rc == 1 and NO_TRACEBACK not in err and "validation: FAILED" in out
    assert re.search(r"\n  - .*" + match, out), out


def test_a_pad_id_edited_with_its_checksum_recomputed_is_refused_by_the_rows(tmp_path):
    """Issue 36: the checksum covers the metadata as written, not an edit that recomputes it. The rows
    tell: every conversation's last label is the pad id the file was packed with (256 here)."""
    path = small_file(tmp_path)

    def edit(meta):
        meta["pad_token_id"] = 5
        meta["metadata_checksum"] = metadata_checksum(meta)

    edit_metadata(path, edit)
    words = r"target_ids row 0: expected pad_token_id 5 as the label of every conversation's last token"
    with pytest.raises(ValueError, match=words):
        read_packed(path)
    rows, _ = pack_conversations([([1, 2, 3], [0, 1, 1]), ([4, 5], [1, 1])], 8, pad_token_id=0)
    with pytest.raises(ValueError, match=words.replace("5", "7")):  # the writer refuses the same mismatch
        write_packed(tmp_path / "w.parquet", rows, pack_length=8, tokenizer=BYTES.identity, pad_token_id=7)
    assert len(read_packed(small_file(tmp_path, "same.parquet"))) == 2  # the pad id it was packed with opens


@pytest.mark.parametrize(("raw", "match"), [pytest.param(r, m, id=i) for i, r, m in BAD_RAW_METADATA])
def test_unreadable_metadata_is_refused(tmp_path, raw, match):
    path = small_file(tmp_path)
    set_raw_metadata(path, raw)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: " + match):
        read_packed(path)
    rc, _, err = cli("inspect", str(path))
    assert_refused(rc, err, match)


def test_inspect_lists_every_problem_not_just_the_first(tmp_path):
    path = small_file(tmp_path)

    def edit(m):
        m.update(alignment=0, pad_token_id=999, pack_length="x", num_rows=5)

    edit_metadata(path, edit)
    rc, out, _ = cli("inspect", str(path))
    problems = [line for line in out.splitlines() if line.startswith("  - ")]
    assert rc == 1 and "validation: FAILED (5 problems)" in out, out
    for words in (
        "metadata pack_length",
        "metadata alignment",
        "metadata pad_token_id",
        "metadata_checksum",
        "num_rows",
    ):
        assert any(words in p for p in problems), (words, problems)
    with pytest.raises(ValueError, match=r"and 4 more:\n  - "):
        read_packed(path)
    assert len(check_packed(path).problems) == 5


# ---- format 1 files ----------------------------------------------------------------------------
def as_format_1(path: Path, edit=None) -> None:
    """Rewrite a file as the format-1 writer did: no max_token_id, no metadata checksum."""

    def to_v1(m):
        m.update(format_version=1)
        del m["max_token_id"], m["metadata_checksum"]
        if edit is not None:
            edit(m)

    edit_metadata(path, to_v1)


def test_a_format_1_file_still_opens_and_says_its_metadata_has_no_checksum(tmp_path):
    path = small_file(tmp_path)
    expected = rows_of(read_packed(path))
    as_format_1(path)
    packed = read_packed(path, tokenizer=BYTES.identity)
    assert rows_of(packed) == expected and not packed.metadata_checksummed
    rc, out, _ = cli("inspect", str(path))
    assert rc == 0 and "note: a format 1 file: its metadata is checked key by key but no checksum covers it" in out


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        pytest.param(_set("alignment", 0), r"metadata alignment: expected an integer", id="alignment 0"),
        pytest.param(_set("pad_token_id", 999), r"metadata pad_token_id: expected a token id", id="pad id 999"),
        pytest.param(_set("alignment", 4), r"packed_cu_seqlens row \d: expected .*multiples of 4", id="alignment 4"),
        pytest.param(_set("metadata_checksum", "0" * 64), r"unknown \['metadata_checksum'\]", id="format 2 key"),
        pytest.param(_set_tok("vocab_hash", ""), r"tokenizer vocab_hash: expected 64", id="empty hash"),
    ],
)
def test_a_format_1_file_is_still_checked_key_by_key(tmp_path, edit, match):
    path = small_file(tmp_path)
    as_format_1(path, edit)
    with pytest.raises(ValueError, match=match):
        read_packed(path)


# ---- schema and bytes ----------------------------------------------------------------------------
def _rewrite_table(path: Path, change) -> None:
    table = pq.read_table(path)
    pq.write_table(change(table).replace_schema_metadata(table.schema.metadata), path)


BAD_SCHEMA = [
    ("a renamed column", lambda t: t.rename_columns(["ids", *t.column_names[1:]]), r"columns: expected \['input_ids'"),
    (
        "an extra column",
        lambda t: t.append_column("x", pa.array([[1]] * len(t), pa.list_(pa.int32()))),
        r"columns: expected",
    ),
    (
        "int64 values",
        lambda t: t.set_column(0, "input_ids", t.column(0).cast(pa.list_(pa.int64()))),
        r"column input_ids: expected list<int32>, got list<\w+: int64>",
    ),
    (
        "a null row",
        lambda t: t.set_column(0, "input_ids", pa.array([None] + t.column(0).to_pylist()[1:], pa.list_(pa.int32()))),
        r"column input_ids: expected no nulls \(rows or values\), got 1",
    ),
    (
        "a null value",
        lambda t: t.set_column(
            1,
            "target_ids",
            pa.array([[None, *t.column(1).to_pylist()[0][1:]], *t.column(1).to_pylist()[1:]], pa.list_(pa.int32())),
        ),
        r"column target_ids: expected no nulls",
    ),
]


@pytest.mark.parametrize(("change", "match"), [pytest.param(c, m, id=i) for i, c, m in BAD_SCHEMA])
def test_a_file_with_another_schema_is_refused(tmp_path, change, match):
    path = small_file(tmp_path)
    _rewrite_table(path, change)
    with pytest.raises(ValueError, match=match):
        read_packed(path)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        pytest.param(lambda b: b[: len(b) // 2], r"file: expected a readable Parquet file, got", id="truncated"),
        pytest.param(lambda b: b"", r"file: expected a readable Parquet file, got", id="empty"),
        pytest.param(lambda b: b'{"text": "a"}\n', r"file: expected a readable Parquet file", id="JSONL"),
    ],
)
def test_a_file_that_is_not_parquet_is_refused(tmp_path, content, match):
    path = small_file(tmp_path)
    path.write_bytes(content(path.read_bytes()))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: " + match):
        read_packed(path)
    rc, _, err = cli("inspect", str(path))
    assert_refused(rc, err, match)


def test_a_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_packed(tmp_path / "missing.parquet")
    assert_refused(*cli("inspect", str(tmp_path / "missing.parquet"))[::2], r"nopad inspect: error: .*No such file")


def _flip_sweep(tmp_path: Path, positions) -> dict[str, int]:
    """Flip one bit at each position: every flip is refused with the path, or changes nothing."""
    path = small_file(tmp_path)
    data = path.read_bytes()
    reference = read_packed(path)
    flipped = tmp_path / "flipped.parquet"
    outcome = {"refused": 0, "harmless": 0}
    for i in positions(data):
        corrupt = bytearray(data)
        corrupt[i] ^= 0x01
        flipped.write_bytes(bytes(corrupt))
        try:
            packed = read_packed(flipped)
        except ValueError as e:
            assert str(e).startswith(f"{flipped}: "), (i, e)
            outcome["refused"] += 1
            continue
        # accepted: then provably harmless, the same metadata and the same rows, byte for byte
        assert packed.metadata == reference.metadata, i
        for f in reference.columns.values:
            assert np.array_equal(packed.columns.values[f], reference.columns.values[f]), (i, f)
            assert np.array_equal(packed.columns.offsets[f], reference.columns.offsets[f]), (i, f)
        outcome["harmless"] += 1
    return outcome


def _metadata_span(data: bytes) -> range:
    """Where the nopad metadata JSON lies in the file's bytes."""
    start = data.index(b'{"alignment"')
    return range(start, data.index(b'"tp_size":1}', start) + len(b'"tp_size":1}'))


def test_byte_flips_in_a_packed_file_are_refused_or_harmless(tmp_path):
    # every third byte of the metadata JSON, and every 17th byte elsewhere (the slow test flips all)
    def positions(data):
        meta = _metadata_span(data)
        return sorted(set(meta[::3]) | set(range(0, len(data), 17)))

    outcome = _flip_sweep(tmp_path, positions)
    assert outcome["refused"] > 100 and outcome["harmless"] > 10, outcome


@pytest.mark.slow
def test_every_byte_flip_in_a_packed_file_is_refused_or_harmless(tmp_path):
    outcome = _flip_sweep(tmp_path, lambda data: range(len(data)))
    assert outcome["refused"] > 1000, outcome


# ---- pack_online ---------------------------------------------------------------------------------
def nested(seqs, dtype=torch.int64):
    values = torch.tensor([t for s in seqs for t in s], dtype=dtype)
    offsets = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(values, offsets)


IDS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
MASK = [[0, 1, 1], [1, 1], [0, 0, 1, 1]]


def _online(**change):
    kwargs = {"input_ids": nested(IDS), "pack_length": 8, "loss_mask": nested(MASK)} | change
    return pack_online(**kwargs)


BAD_ONLINE = [
    (
        "mask 0.5",
        {"loss_mask": nested([[0, 1, 1], [1, 0.5], [0, 0, 1, 1]], torch.float32)},
        r"loss_mask row 1: expected only 0 and 1 \(a mask is not a weight\), got 0.5",
    ),
    (
        "mask 2",
        {"loss_mask": nested([[0, 1, 1], [1, 1], [0, 2, 1, 1]])},
        r"loss_mask row 2: expected only 0 and 1 .*got 2",
    ),
    (
        "mask -1",
        {"loss_mask": nested([[-1, 1, 1], [1, 1], [0, 0, 1, 1]])},
        r"loss_mask row 0: expected only 0 and 1 .*got -1",
    ),
    (
        "mask NaN",
        {"loss_mask": nested([[0, 1, 1], [1, 1], [0, 0, 1, math.nan]], torch.float32)},
        r"loss_mask row 2: .*got nan",
    ),
    (
        "mask of other offsets",
        {"loss_mask": nested([[0, 1], [1, 1, 1], [0, 0, 1, 1]])},
        r"loss_mask: expected the same offsets \(sequence lengths\) as input_ids",
    ),
    ("mask of other rows", {"loss_mask": nested([[0, 1, 1], [1, 1]])}, r"loss_mask: expected the same offsets"),
    ("mask dense", {"loss_mask": torch.ones(3, 4)}, r"loss_mask: expected a jagged nested tensor"),
    (
        "mask complex",
        {"loss_mask": nested(MASK, torch.complex64)},
        r"loss_mask: expected a bool, integer or float dtype",
    ),
    (
        "float ids",
        {"input_ids": nested(IDS, torch.float32)},
        r"input_ids: expected an integer dtype \(token ids\), got torch.float32",
    ),
    ("bool ids", {"input_ids": nested(IDS, torch.bool)}, r"input_ids: expected an integer dtype"),
    (
        "negative id",
        {"input_ids": nested([[1, 2, 3], [4, 5], [6, 7, -8, 9]])},
        r"input_ids row 2: expected token ids >= 0, got -8",
    ),
    (
        "dense ids",
        {"input_ids": torch.zeros(2, 3, dtype=torch.int64), "loss_mask": None},
        r"input_ids: expected a jagged nested tensor",
    ),
    (  # issue 36: values before the first offset belong to no row, and were packed as the first row's
        "offsets not from 0",
        {
            "input_ids": torch.nested.nested_tensor_from_jagged(torch.arange(1, 10), torch.tensor([2, 5, 9])),
            "loss_mask": None,
        },
        r"input_ids: expected offsets from 0 to its 9 values \(each value in a row\), got offsets 2..9",
    ),
    (
        "offsets short of the values",
        {
            "input_ids": torch.nested.nested_tensor_from_jagged(torch.arange(1, 10), torch.tensor([0, 3, 5])),
            "loss_mask": None,
        },
        r"input_ids: expected offsets from 0 to its 9 values \(each value in a row\), got offsets 0..5",
    ),
    ("pack_length True", {"pack_length": True}, r"pack_length: expected an int >= 1, got True"),
    ("pack_length 0", {"pack_length": 0}, r"pack_length: expected an int >= 1, got 0"),
    ("pack_length 8.0", {"pack_length": 8.0}, r"pack_length: expected an int >= 1, got 8.0"),
    ("pack_length too short", {"pack_length": 3}, r"input_ids row 2: expected 1 to 3 tokens after padding"),
    ("tp_size 0", {"tp_size": 0}, r"tp_size: expected an int >= 1, got 0"),
    ("cp_size True", {"cp_size": True}, r"cp_size: expected an int >= 1, got True"),
    ("dp_size 0", {"dp_size": 0}, r"dp_size: expected an int >= 1, got 0"),
    ("min_bins -1", {"min_bins": -1}, r"min_bins: expected an int >= 0, got -1"),
    ("pad id -1", {"pad_token_id": -1}, r"pad_token_id: expected an int >= 0, got -1"),
    ("pad id 1.5", {"pad_token_id": 1.5}, r"pad_token_id: expected an int >= 0, got 1.5"),
    ("unknown algorithm", {"algorithm": "nope"}, r"algorithm: expected one of \["),
    ("unknown layout", {"cp_layout": "diagonal"}, r"cp_layout: expected one of"),
]


@pytest.mark.parametrize(("change", "match"), [pytest.param(c, m, id=i) for i, c, m in BAD_ONLINE])
def test_pack_online_refuses(change, match):
    kept = {k: v.values().clone() if isinstance(v, torch.Tensor) and v.is_nested else v for k, v in change.items()}
    with pytest.raises(ValueError, match=match):
        _online(**change)
    for k, v in change.items():  # nothing mutated
        if isinstance(v, torch.Tensor) and v.is_nested:
            torch.testing.assert_close(v.values(), kept[k], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.float32, torch.bfloat16])
def test_pack_online_takes_a_0_1_mask_of_any_real_dtype_exactly(dtype):
    reference, bins = _online()
    rows, same_bins = _online(loss_mask=nested(MASK, dtype))
    assert same_bins == bins and set(rows.keys()) == set(reference.keys())
    assert all(torch.equal(rows[k], reference[k]) for k in reference.keys())


# ---- collate_packed and write_packed -------------------------------------------------------------
def _rows():
    rows, _ = pack_conversations([([1, 2, 3], [0, 1, 1]), ([4, 5], [1, 1])], 8, pad_token_id=0)
    return rows


def _with(field, value, row=0):
    rows = _rows()
    rows[row] = dict(rows[row], **{field: value})
    return rows


BAD_COLLATE = [
    (
        "float ids",
        lambda: (_with("input_ids", np.array([1.0, 2.5, 3.0, 4.0, 5.0])), {}),
        r"input_ids row 0: expected a 1-D array of integers, got 1-D float64",
    ),
    (
        "bool mask",
        lambda: (_with("token_mask", np.ones(5, bool)), {}),
        r"token_mask row 0: expected a 1-D array of integers, got 1-D bool",
    ),
    (
        "2-D positions",
        lambda: (_with("position_ids", np.zeros((5, 1), np.int64)), {}),
        r"position_ids row 0: expected a 1-D array of integers, got 2-D int64",
    ),
    (
        "uint64 ids",
        lambda: (_with("input_ids", np.arange(5, dtype=np.uint64)), {}),
        r"input_ids row 0: expected a 1-D array of integers, got 1-D uint64",
    ),
    (
        "negative id",
        lambda: (_with("input_ids", np.array([1, 2, 3, -4, 5])), {}),
        r"input_ids row 0: expected token ids >= 0, got -4",
    ),
    (
        "a row missing a field",
        lambda: ([{k: v for k, v in r.items() if k != "position_ids"} for r in _rows()], {}),
        r"rows row 0: expected fields",
    ),
    (
        "rows a dict",
        lambda: (_rows()[0], {}),
        r"rows: expected a sequence of packed rows \(dicts of arrays\), got dict",
    ),
    ("a row a list", lambda: ([[1, 2, 3]], {}), r"rows row 0: expected a dict of the row fields, got list"),
    ("no rows", lambda: ([], {}), r"rows: expected at least one packed row, got an empty batch"),
    ("pad id -1", lambda: (_rows(), {"pad_token_id": -1}), r"pad_token_id: expected an int >= 0, got -1"),
    ("pad id a float", lambda: (_rows(), {"pad_token_id": 0.0}), r"pad_token_id: expected an int >= 0, got 0.0"),
    ("alignment 0", lambda: (_rows(), {"alignment": 0}), r"alignment: expected an int >= 1, got 0"),
    ("alignment True", lambda: (_rows(), {"alignment": True}), r"alignment: expected an int >= 1, got True"),
]


@pytest.mark.parametrize(("make", "match"), [pytest.param(c, m, id=i) for i, c, m in BAD_COLLATE])
def test_collate_packed_refuses(make, match):
    rows, kwargs = make()
    before = copy.deepcopy(rows)
    with pytest.raises(ValueError, match=match):
        collate_packed(rows, **kwargs)
    assert repr(rows) == repr(before)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        pytest.param({"alignment": 0}, r"alignment: expected an int >= 1, got 0", id="alignment 0"),
        pytest.param({"alignment": 2.0}, r"alignment: expected an int >= 1, got 2.0", id="alignment a float"),
        pytest.param(
            {"fields": ["labels"]},
            r"batch: expected the fields of collate_packed .*missing \['labels'\]",
            id="no such field",
        ),
        pytest.param(
            {"drop": "packed_cu_seqlens_lengths"}, r"missing \['packed_cu_seqlens_lengths'\]", id="no lengths"
        ),
        pytest.param(
            {"drop": "packed_cu_seqlens"}, r"batch: expected packed rows carrying packed_cu_seqlens", id="unpacked"
        ),
    ],
)
def test_packed_to_nested_refuses(change, match):
    from nopad.packing import packed_to_nested

    batch = collate_packed(_rows())
    change = dict(change)
    if "drop" in change:
        batch = batch.exclude(change.pop("drop"))
    with pytest.raises(ValueError, match=match):
        packed_to_nested(batch, **change)


def test_collate_takes_int32_arrays_and_lists_exactly():
    reference = collate_packed(_rows())
    for convert in (lambda a: a.astype(np.int32), lambda a: a.tolist()):
        batch = collate_packed([{k: convert(v) for k, v in r.items()} for r in _rows()])
        assert all(torch.equal(batch[k], reference[k]) for k in reference.keys())


def _write(tmp_path, rows=None, **change):
    kwargs = {"pack_length": 8, "tokenizer": BYTES.identity, "pad_token_id": 0} | change
    return write_packed(tmp_path / "w.parquet", _rows() if rows is None else rows, **kwargs)


BAD_WRITES = [
    ("alignment 0", {"alignment": 0}, r"alignment: expected an int >= 1, got 0"),
    ("pack_length not a multiple", {"alignment": 3}, r"metadata alignment: expected a divisor of pack_length 8, got 3"),
    (
        "cp_size the alignment cannot serve",
        {"alignment": 2, "cp_size": 2, "tp_size": 2},
        r"metadata alignment: expected a multiple of tp_size \* cp_size = 4",
    ),
    ("tp_size True", {"tp_size": True}, r"tp_size: expected an int >= 1, got True"),
    (
        "pad id past the vocabulary",
        {"pad_token_id": 258},
        r"metadata pad_token_id: expected a token id in \[0, 257\], got 258",
    ),
    (
        "a tokenizer name, not an identity",
        {"tokenizer": "bytes"},
        r"metadata tokenizer: expected an object with exactly the keys",
    ),
    (
        "a report that is not JSON",
        {"report": {"seen": {1, 2}}},
        r"metadata: expected JSON values only \(the report included; no NaN\)",
    ),
    ("a report with NaN", {"report": {"utilisation": math.nan}}, r"metadata: expected JSON values only"),
    (
        "float rows",
        {"rows": _with("target_ids", np.zeros(5))},
        r"target_ids row 0: expected a 1-D array of integers, got 1-D float64",
    ),
    (
        "ids past the vocabulary",
        {"rows": _with("input_ids", np.array([1, 2, 300, 4, 5]))},
        r"input_ids row 0: expected token ids in \[0, 258\)",
    ),
    (
        "ids past int32",
        {"rows": _with("input_ids", np.array([2**31, 2, 3, 4, 5])), "tokenizer": PreTokenized().identity},
        r"metadata max_token_id: expected a token id in \[0, 2147483647\]",
    ),
    (
        "a negative id, vocabulary unknown",
        {"rows": _with("input_ids", np.array([-3, 2, 3, 4, 5])), "tokenizer": PreTokenized().identity},
        r"input_ids row 0: expected token ids >= 0, got -3",
    ),
]


@pytest.mark.parametrize(("change", "match"), [pytest.param(c, m, id=i) for i, c, m in BAD_WRITES])
def test_write_packed_refuses_what_read_packed_would(tmp_path, change, match):
    change = dict(change)
    rows = change.pop("rows", None)
    with pytest.raises(ValueError, match=match):
        _write(tmp_path, rows, **change)
    assert not (tmp_path / "w.parquet").exists()


# ---- CLI arguments of every subcommand -----------------------------------------------------------
def _src(tmp_path):
    return str(jsonl(tmp_path, ['{"text": "a"}']))


def _out(tmp_path):
    return str(tmp_path / "o.parquet")


BAD_ARGS = [
    (
        "pack: pack length 0",
        lambda t: ["pack", _src(t), "-o", _out(t), "--pack-length", "0"],
        r"--pack-length: expected an integer >= 1, got 0",
    ),
    (
        "pack: pack length not a number",
        lambda t: ["pack", _src(t), "-o", _out(t), "--pack-length", "8k"],
        r"argument --pack-length: invalid int value: '8k'",
    ),
    (
        "pack: pack length not a multiple",
        lambda t: ["pack", _src(t), "-o", _out(t), "--pack-length", "10", "--cp-size", "2"],
        r"pack_length: expected a positive multiple of the alignment 4, got 10",
    ),
    (
        "pack: cp size 0",
        lambda t: ["pack", _src(t), "-o", _out(t), "--pack-length", "8", "--cp-size", "0"],
        r"--cp-size: expected an integer >= 1, got 0",
    ),
    (
        "pack: tp size -1",
        lambda t: ["pack", _src(t), "-o", _out(t), "--pack-length", "8", "--tp-size", "-1"],
        r"--tp-size: expected an integer >= 1, got -1",
    ),
    (
        "pack: vocab size 0",
        lambda t: ["pack", _src(t), "-o", _out(t), "--pack-length", "8", "--vocab-size", "0"],
        r"--vocab-size: expected an integer >= 1, got 0",
    ),
    (
        "pack: pad id -1",
        lambda t: ["pack", _src(t), "-o", _out(t), "--pack-length", "8", "--pad-token-id", "-1"],
        r"--pad-token-id: expected an integer >= 0, got -1",
    ),
    (
        "pack: unknown overflow",
        lambda t: ["pack", _src(t), "-o", _out(t), "--pack-length", "8", "--overflow", "drop"],
        r"argument --overflow: invalid choice: 'drop'",
    ),
    (
        "pack: output is the input",
        lambda t: ["pack", _src(t), "-o", _src(t), "--pack-length", "8"],
        r"--output: expected a path other than the input",
    ),
    (
        "pack: output folder missing",
        lambda t: ["pack", _src(t), "-o", str(t / "no" / "o.parquet"), "--pack-length", "8"],
        r"--output: expected a file in an existing folder",
    ),
    (
        "pack: input missing",
        lambda t: ["pack", str(t / "missing.jsonl"), "-o", _out(t), "--pack-length", "8"],
        r"nopad pack: error: .*No such file",
    ),
    (
        "pack: input a folder",
        lambda t: ["pack", str(t), "-o", _out(t), "--pack-length", "8"],
        r"nopad pack: error: .*Is a directory",
    ),
    ("inspect: bins 0", lambda t: ["inspect", _out(t), "--bins", "0"], r"--bins: expected an integer >= 1, got 0"),
    (
        "inspect: tokenizer missing",
        lambda t: ["inspect", str(small_file(t)), "--tokenizer", str(t / "missing")],
        r"nopad inspect: error: tokenizer: expected a local directory",
    ),
    (
        "demo: batch size 0",
        lambda t: ["demo", "--batch-size", "0"],
        r"nopad demo: error: --batch-size: expected an integer >= 1, got 0",
    ),
    (
        "demo: prompt length -5",
        lambda t: ["demo", "--prompt-len", "-5"],
        r"--prompt-len: expected an integer >= 1, got -5",
    ),
    ("demo: seed -1", lambda t: ["demo", "--seed", "-1"], r"--seed: expected an integer >= 0, got -1"),
    (
        "demo: device foo",
        lambda t: ["demo", "--device", "foo"],
        r"--device: expected a torch device such as cpu or cuda:0, got 'foo'",
    ),
    (
        "demo: device index past the devices",
        lambda t: ["demo", "--device", "cuda:99"],
        r"--device: expected (a device this machine has|an index below)",
    ),
    ("demo: unknown arch", lambda t: ["demo", "--arch", "gpt"], r"argument --arch: invalid choice: 'gpt'"),
    (
        "bench: a batch size 0",
        lambda t: ["bench", "--batch-sizes", "8", "0"],
        r"nopad bench: error: --batch-sizes: expected an integer >= 1, got 0",
    ),
    ("bench: repeats 0", lambda t: ["bench", "--repeats", "0"], r"--repeats: expected an integer >= 1, got 0"),
    (
        "bench: response length 0",
        lambda t: ["bench", "--response-len", "0"],
        r"--response-len: expected an integer >= 1, got 0",
    ),
    ("bench: device bogus", lambda t: ["bench", "--device", "bogus:0"], r"--device: expected a torch device"),
    (
        "bench: plot folder missing",
        lambda t: ["bench", "--plot", str(t / "no" / "x.png")],
        r"--plot: expected a file in an existing folder",
    ),
    (
        "several problems at once",
        lambda t: ["demo", "--batch-size", "0", "--device", "foo"],
        r"--batch-size: expected an integer >= 1, got 0; --device: expected",
    ),
]


@pytest.mark.parametrize(("argv", "match"), [pytest.param(a, m, id=i) for i, a, m in BAD_ARGS])
def test_a_bad_argument_is_a_message_and_exit_2_never_a_traceback(tmp_path, argv, match):
    rc, out, err = cli(*argv(tmp_path))
    assert_refused(rc, err, match)
    assert not (tmp_path / "o.parquet").exists()


@pytest.mark.parametrize(
    ("argv", "lines", "match"),
    [
        (["pack", "IN", "-o", "OUT", "--pack-length", "8"], ['{"input_ids": [1, 2.5]}'], r"IN: record line 1: "),
        pytest.param(
            ["inspect", "IN"],
            ["not parquet"],
            r"nopad inspect: error: .*expected a readable Parquet file",
            marks=pytest.mark.slow,
        ),
        pytest.param(["demo", "--device", "foo"], [], r"nopad demo: error: .*--device", marks=pytest.mark.slow),
    ],
    ids=["pack", "inspect", "demo"],
)
def test_the_installed_command_prints_no_traceback(tmp_path, argv, lines, match):
    src = jsonl(tmp_path, lines)
    argv = [str(src) if a == "IN" else str(tmp_path / "o.parquet") if a == "OUT" else a for a in argv]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "nopad", *argv], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2 and NO_TRACEBACK not in done.stderr, done.stderr
    assert re.search(match.replace("IN", re.escape(str(src))), done.stderr), done.stderr


# ---- valid edge inputs: exact results ------------------------------------------------------------
VALID_EDGES = [
    ("byte-order mark", b'\xef\xbb\xbf{"text": "a"}\n', [], [[97, 257]]),
    ("CRLF line ends", b'{"text": "a"}\r\n{"text": "b"}\r\n', [], [[97, 257], [98, 257]]),
    ("no newline at the end", b'{"text": "a"}', [], [[97, 257]]),
    ("other keys are ignored", b'{"text": "a", "id": 7, "source": "web"}\n', [], [[97, 257]]),
    ("a longer key that starts alike is ignored", b'{"input_ids": [1, 2], "input_ids_len": 2}\n', [], [[1, 2]]),
    ("empty text is just eos", b'{"text": ""}\n', [], [[257]]),
    ("unicode text", '{"text": "é"}\n'.encode(), [], [[0xC3, 0xA9, 257]]),
    ("a mask of zeros", b'{"input_ids": [1, 2], "loss_mask": [0, 0]}\n', [], [[1, 2]]),
    ("an empty conversation is counted, not an error", b'{"input_ids": []}\n{"input_ids": [5]}\n', [], [[5]]),
    ("an exact fill", b'{"input_ids": [1, 2, 3, 4, 5, 6, 7, 8]}\n', [], [[1, 2, 3, 4, 5, 6, 7, 8]]),
    ("ids up to the stated vocabulary", b'{"input_ids": [0, 99]}\n', ["--vocab-size", "100"], [[0, 99]]),
    ("the largest int32 id", b'{"input_ids": [2147483647]}\n', [], [[2147483647]]),
    (
        "tool and system roles",
        b'{"messages": [{"role": "system", "content": ""}, {"role": "tool", "content": "x"}]}\n',
        [],
        None,
    ),
]


@pytest.mark.parametrize(("content", "args", "expected"), [pytest.param(c, a, e, id=i) for i, c, a, e in VALID_EDGES])
def test_valid_edge_inputs_pack_exactly(tmp_path, content, args, expected):
    rc, _, err = pack_cli(tmp_path, jsonl(tmp_path, content), *args, pack_length=8)
    assert rc == 0, err
    packed = read_packed(tmp_path / "out.parquet")
    if expected is None:  # no assistant: every token is context, and eos is not learned either
        assert packed[0]["token_mask"].sum() == 0
    else:
        assert segments(packed) == expected


# ---- hypothesis: near-valid inputs, one field off ------------------------------------------------
VOCAB = 258
ids_st = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
valid_record = st.one_of(
    ids_st.map(lambda ids: {"input_ids": ids}),
    ids_st.flatmap(
        lambda ids: st.lists(st.integers(0, 1), min_size=len(ids), max_size=len(ids)).map(
            lambda m: {"input_ids": ids, "loss_mask": m}
        )
    ),
    st.text(max_size=8).map(lambda t: {"text": t}),
    st.lists(
        st.tuples(st.sampled_from(["user", "assistant", "system"]), st.text(max_size=5)), min_size=1, max_size=3
    ).map(lambda ms: {"messages": [{"role": r, "content": c} for r, c in ms]}),
)
not_an_int = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.text(max_size=3),
    st.none(),
    st.lists(st.integers(), max_size=2),
)
not_an_id = st.one_of(not_an_int, st.integers(max_value=-1), st.integers(min_value=VOCAB))
not_a_mask_value = st.one_of(not_an_int, st.integers(max_value=-1), st.integers(min_value=2))
not_a_string = st.one_of(
    st.integers(), st.floats(allow_nan=False), st.booleans(), st.none(), st.lists(st.text(max_size=2), max_size=2)
)


@st.composite
def one_field_off(draw):
    """A valid record with exactly one thing made wrong; every result must be refused."""
    record = copy.deepcopy(draw(valid_record))
    if "input_ids" in record:
        where = draw(st.sampled_from(["id", "mask value", "mask length", "ids type", "extra kind"]))
        n = len(record["input_ids"])
        if where == "id":
            record["input_ids"][draw(st.integers(0, n - 1))] = draw(not_an_id)
        elif where == "mask value":
            record["loss_mask"] = [1] * n
            record["loss_mask"][draw(st.integers(0, n - 1))] = draw(not_a_mask_value)
        elif where == "mask length":
            record["loss_mask"] = [1] * (n + draw(st.sampled_from([-1, 1])))
        elif where == "ids type":
            record["input_ids"] = draw(
                st.one_of(
                    st.text(max_size=3),
                    st.none(),
                    st.integers(),
                    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
                )
            )
        else:
            record["text"] = "x"
    elif "text" in record:
        where = draw(st.sampled_from(["text type", "mask", "typo"]))
        if where == "text type":
            record["text"] = draw(not_a_string)
        elif where == "mask":
            record["loss_mask"] = [1]
        else:
            record["texts"] = "x"  # a near-miss of "text"
    else:
        k = draw(st.integers(0, len(record["messages"]) - 1))
        where = draw(st.sampled_from(["role", "content", "missing", "not an object", "empty"]))
        if where in ("role", "content"):
            record["messages"][k][where] = draw(not_a_string)
        elif where == "missing":
            del record["messages"][k][draw(st.sampled_from(["role", "content"]))]
        elif where == "not an object":
            record["messages"][k] = draw(not_a_string)
        else:
            record["messages"] = []
    return record


@given(one_field_off())
def test_near_valid_records_are_refused_naming_the_line(record):
    with pytest.raises(ValueError, match=r"^record line 3: "):
        encode_record(record, BYTES, line=3)


@given(valid_record)
def test_valid_records_encode_exactly(record):
    ids, mask = encode_record(record, BYTES)
    if "input_ids" in record:
        assert ids == record["input_ids"] and mask == record.get("loss_mask", [1] * len(ids))
    elif "text" in record:
        assert ids == [*record["text"].encode(), 257] and mask == [1] * len(ids)
    else:
        assert ids[-1] == 257 and len(mask) == len(ids) and set(mask) <= {0, 1}


META_KEYS = [
    "pack_length",
    "alignment",
    "tp_size",
    "cp_size",
    "pad_token_id",
    "num_rows",
    "max_token_id",
    "report",
    "rows_checksum",
    "format_version",
    "tokenizer.name",
    "tokenizer.vocab_hash",
    "tokenizer.vocab_size",
]
json_value = st.one_of(
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.text(max_size=4),
    st.just([]),
    st.just({}),
)


def _put(meta, key, value):
    head, _, sub = key.partition(".")
    (meta[head] if sub else meta).__setitem__(sub or head, value)


def _get(meta, key):
    head, _, sub = key.partition(".")
    return meta[head][sub] if sub else meta[head]


@pytest.fixture(scope="module")
def small_file_bytes(tmp_path_factory):
    return small_file(tmp_path_factory.mktemp("near-valid")).read_bytes()


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(META_KEYS), value=json_value)
def test_any_one_metadata_key_changed_is_refused(tmp_path, small_file_bytes, key, value):
    path = tmp_path / "near.parquet"
    path.write_bytes(small_file_bytes)
    meta = read_metadata(path)
    if _get(meta, key) == value and type(_get(meta, key)) is type(value):
        return  # not a change
    edit_metadata(path, lambda m: _put(m, key, value))
    problems = check_packed(path).problems
    assert problems, (key, value)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    key=st.sampled_from(["pack_length", "alignment", "tp_size", "cp_size", "pad_token_id", "num_rows"]),
    value=st.one_of(not_an_int, st.integers(-5, -1)),
)
def test_a_format_1_key_of_the_wrong_type_or_range_is_refused_by_name(tmp_path, small_file_bytes, key, value):
    path = tmp_path / "near-v1.parquet"
    path.write_bytes(small_file_bytes)
    as_format_1(path, lambda m: m.__setitem__(key, value))
    problems = check_packed(path).problems
    assert any(p.startswith(f"metadata {key}:") for p in problems), (key, value, problems)


@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    data=st.data(),
    bad=st.sampled_from([0.5, 0.25, 2.0, -1.0, math.nan, 3.0]),
)
def test_a_loss_mask_one_value_off_is_refused_naming_its_row(lengths, data, bad):
    seqs = [list(range(1, n + 1)) for n in lengths]
    masks = [[float(data.draw(st.integers(0, 1))) for _ in s] for s in seqs]
    row = data.draw(st.integers(0, len(seqs) - 1))
    masks[row][data.draw(st.integers(0, len(masks[row]) - 1))] = bad
    with pytest.raises(ValueError, match=rf"loss_mask row {row}: expected only 0 and 1"):
        pack_online(nested(seqs), 8, loss_mask=nested(masks, torch.float32))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=25)
@given(
    convs=st.lists(
        st.lists(st.one_of(st.just(0), st.just(999), st.integers(0, 999)), min_size=0, max_size=8),
        min_size=1,
        max_size=6,
    )
)
def test_valid_pre_tokenized_edges_round_trip_exactly(tmp_path, convs):
    if not any(convs):
        convs = [*convs, [999]]  # at least one row to write
    src = jsonl(tmp_path, [json.dumps({"input_ids": c}) for c in convs])
    # concatenative keeps the input order (the default, best fit, puts the longest first)
    rc, _, err = pack_cli(tmp_path, src, "--vocab-size", "1000", "--algorithm", "concatenative", pack_length=8)
    assert rc == 0, err
    packed = read_packed(tmp_path / "out.parquet", tokenizer=PreTokenized(1000).identity)
    assert segments(packed) == [c for c in convs if c]  # empties counted, every other one exact
    assert packed.metadata["report"]["rejected_empty"] == sum(1 for c in convs if not c)
    assert packed.metadata["max_token_id"] == max(t for c in convs for t in c)


def test_the_metadata_checksum_covers_every_key_but_itself(tmp_path):
    meta = read_metadata(small_file(tmp_path))
    assert metadata_checksum(meta) == meta["metadata_checksum"]
    for key in meta:
        if key != "metadata_checksum":
            changed = {**meta, key: "changed"}
            assert metadata_checksum(changed) != meta["metadata_checksum"], key


# ---- issue 22: coercions, counts and messages in the packers ---------------------------------------
def _pack(ids, **kwargs):
    return lambda: pack_conversations([([3, 4], [1, 1]), (ids, [1] * len(ids))], 8, **kwargs)


def _metrics(bins, lengths, capacity):
    from nopad.packing import packing_metrics

    return lambda: packing_metrics(bins, lengths, capacity)


def _lengths(**kwargs):
    from nopad.packing import pack_lengths

    return lambda: pack_lengths([3, 4, 5], 8, **kwargs)


PACKER_CASES = [
    (
        "coercion",
        "bool ids array",
        _pack(np.array([True, False])),
        r"input_ids conversation 1: expected a 1-D "
        r"sequence of integer token ids, got shape \(2,\) dtype bool",
    ),
    (
        "coercion",
        "bool ids list",
        _pack([True, True, False]),
        r"input_ids conversation 1: .*got shape \(3,\) dtype bool",
    ),
    (
        "coercion",
        "a negative id",
        _pack([1, -2, 3]),
        r"input_ids conversation 1: expected token ids in \[0, 2\*\*63\), "
        r"got -2",
    ),
    (
        "coercion",
        "a uint64 id past 2**63",
        _pack(np.array([1, 2**63 + 5], dtype=np.uint64)),
        r"input_ids conversation 1: expected token ids below 2\*\*63 \(int64\), got 9223372036854775813",
    ),
    ("coercion", "a float pad id", _pack([1], pad_token_id=2.5), r"pad_token_id: expected an int >= 0, got 2.5"),
    ("coercion", "a negative pad id", _pack([1], pad_token_id=-1), r"pad_token_id: expected an int >= 0, got -1"),
    (
        "coercion",
        "a bool pack length",
        lambda: pack_conversations([([1], [1])], True),
        r"pack_length: expected an int >= 1, got True",
    ),
    ("coercion", "a float alignment", _pack([1], alignment=2.5), r"alignment: expected an int >= 1, got 2.5"),
    (
        "coercion",
        "bins multiple of 2.5",
        _lengths(bins_multiple_of=2.5),
        r"bins_multiple_of: expected an int >= 1, "
        r"got 2.5",
    ),
    ("coercion", "min bins 1.5", _lengths(min_bins=1.5), r"min_bins: expected an int >= 0, got 1.5"),
    (
        "coercion",
        "capacity 2.5",
        lambda: __import__("nopad.packing").packing.pack_lengths([1, 2], 2.5),
        r"capacity: expected an int >= 1, got 2.5",
    ),
    (
        "coercion",
        "a string seed",
        lambda: __import__("nopad.packing._algorithms").packing._algorithms.first_fit_shuffle([1, 2], 4, seed="a"),
        r"seed: expected an int, got 'a'",
    ),
    (
        "coercion",
        "float lengths to metrics",
        _metrics([[0]], [3.5], 4),
        r"lengths: expected a 1-D tensor or sequence of integers \(nothing is rounded\), got list of dtype float64",
    ),
    (
        "wrong result",
        "bins over the capacity",
        _metrics([[0, 1]], [3, 3], 4),
        r"bins\[0\]: expected at most the "
        r"capacity of 4 tokens, got 6 tokens",
    ),
    ("weak message", "metrics capacity 0", _metrics([[0]], [3], 0), r"capacity: expected an int >= 1, got 0"),
    (
        "weak message",
        "metrics bins past the items",
        _metrics([[5]], [3], 4),
        r"bins\[0\]: expected item indices in "
        r"\[0, 1\), got \[5\]",
    ),
    ("weak message", "min bins a string", _lengths(min_bins="2"), r"min_bins: expected an int >= 0, got '2'"),
    (
        "weak message",
        "fields as one string",
        lambda: __import__("nopad.packing").packing.packed_to_nested(collate_packed(_rows()), "input_ids"),
        r"fields: expected a list of field names, got the string 'input_ids' \(write \['input_ids'\]\)",
    ),
    (
        "weak message",
        "a tokenizer name where an identity belongs",
        lambda: check_packed("nowhere.parquet", tokenizer="bytes"),
        r"tokenizer: expected a TokenizerIdentity \(e.g. load_tokenizer\(...\).identity\) or None, got str",
    ),
    (
        "weak message",
        "a CP rank past the CP size",
        lambda: __import__("nopad.packing").packing.packed_to_thd(collate_packed(_rows()), cp_size=2, cp_rank=3),
        r"cp_rank: expected an int in \[0, cp_size=2\), got 3",
    ),
]


@pytest.mark.parametrize(("call", "match"), [pytest.param(c, m, id=f"{k}: {i}") for k, i, c, m in PACKER_CASES])
def test_the_packers_refuse_saying_what_to_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


CLI_CASES_22 = [
    (
        "pack: an empty tokenizer name is refused, not replaced",
        lambda t: [
            "pack",
            str(jsonl(t, ['{"input_ids": [1]}'])),
            "-o",
            _out(t),
            "--pack-length",
            "8",
            "--tokenizer-name",
            "",
        ],
        r"tokenizer name: expected a non-empty string, got ''",
    ),
    (
        "pack: the output is a folder",
        lambda t: ["pack", _src(t), "-o", str(t), "--pack-length", "8"],
        r"--output: expected a file to write, got the folder",
    ),
    (
        "pack: a pack length past int32, before any reading",
        lambda t: ["pack", _src(t), "-o", _out(t), "--pack-length", "99999999999"],
        r"--pack-length: expected an int in \[1, 2147483647\], got 99999999999",
    ),
    (
        "pack: a pad id past int32 says the range",
        lambda t: [
            "pack",
            str(jsonl(t, ['{"input_ids": [1]}'])),
            "-o",
            _out(t),
            "--pack-length",
            "8",
            "--tokenizer-name",
            "mine",
            "--pad-token-id",
            "99999999999",
        ],
        r"--pad-token-id: expected an int in \[0, 2147483647\], got 99999999999",
    ),
    (
        "pack: a vocabulary past int32 says the range",
        lambda t: ["pack", _src(t), "-o", _out(t), "--pack-length", "8", "--vocab-size", "99999999999"],
        r"vocab_size: expected an int in \[1, 2147483648\], got 99999999999",
    ),
]


@pytest.mark.parametrize(("argv", "match"), [pytest.param(a, m, id=i) for i, a, m in CLI_CASES_22])
def test_issue_22_arguments_are_refused_with_the_words_and_exit_2(tmp_path, argv, match):
    rc, out, err = cli(*argv(tmp_path))
    assert_refused(rc, err, match)
    assert not (tmp_path / "o.parquet").exists()


def test_numpy_ints_are_ints_for_the_packers_and_files(tmp_path):
    rows, report = pack_conversations([([3, 4, 5], [1, 1, 1]), ([6], [1])], np.int64(8), alignment=np.int32(2))
    want, _ = pack_conversations([([3, 4, 5], [1, 1, 1]), ([6], [1])], 8, alignment=2)
    assert all(np.array_equal(a[f], b[f]) for a, b in zip(rows, want) for f in a)
    assert report.pack_length == 8 and type(report.pack_length) is int
    meta = write_packed(
        tmp_path / "n.parquet",
        rows,
        pack_length=np.int64(8),
        tokenizer=BYTES.identity,
        pad_token_id=np.int16(0),
        alignment=np.int64(2),
    )
    assert meta["pack_length"] == 8 and type(meta["pack_length"]) is int
    assert read_packed(tmp_path / "n.parquet", tokenizer=BYTES.identity).metadata["alignment"] == 2
    assert PreTokenized(np.int64(300), pad_token_id=np.int64(7)).identity.vocab_size == 300
    ids = [np.array([3, 4], dtype=np.uint16), np.array([5], dtype=np.int8), (6, 7)]
    packed, _ = pack_conversations([(x, [1] * len(x)) for x in ids], 8)
    assert packed[0]["input_ids"].tolist() == [3, 4, 5, 6, 7]
