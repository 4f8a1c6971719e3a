"""Offline packing, packed Parquet files, collate and the pack/inspect CLI."""

import json
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# private: the columns of a packed row are validated on their own
from nopad._apps.cli import main
from nopad.packing import (
    ALGORITHMS,
    ByteTokenizer,
    TokenizerIdentity,
    collate_packed,
    encode_record,
    load_tokenizer,
    pack_conversations,
    pack_lengths,
    read_packed,
    write_packed,
)
from nopad.packing._rows import Columns, validate_columns

BYTES = ByteTokenizer()
PAD = 10**9  # a pad id no conversation uses, so padding is told from tokens (a pad id is an id: >= 0)


def _conversations(lengths):
    """Conversation k holds distinct ids (so a lost or repeated token is visible), mask all ones."""
    out, nxt = [], 0
    for n in lengths:
        out.append((list(range(nxt, nxt + n)), [1] * n))
        nxt += n
    return out


def _real_tokens(rows):
    """Every non-padding token in row order (padding is the pad id PAD here)."""
    return [int(t) for r in rows for t in r["input_ids"] if t != PAD]


# ---- seed 002: the exact fill ------------------------------------------------------------------
@pytest.mark.parametrize("order", ["as packed", "reversed", "one dropped", "one copied"])
def test_columns_from_rows_equal_the_concatenation_and_share_the_packers_arrays_only_when_back_to_back(order):
    rows, _ = pack_conversations(_conversations([5, 9, 3, 12, 7, 4]), 16)
    picked = {
        "as packed": rows,
        "reversed": rows[::-1],
        "one dropped": rows[:1] + rows[2:],
        "one copied": [rows[0], {f: a.copy() for f, a in rows[1].items()}, *rows[2:]],
    }[order]
    cols = Columns.from_rows(picked)
    for f in rows[0]:
        assert np.array_equal(cols.values[f], np.concatenate([r[f] for r in picked]))
        assert np.array_equal(cols.row(1)[f], picked[1][f])
        assert np.shares_memory(cols.values[f], rows[0][f]) == (order == "as packed")


def test_exact_fill_closes_the_pack_with_no_repeated_boundary():
    rows, report = pack_conversations(_conversations([6, 3]), 6)
    assert [r["packed_cu_seqlens"].tolist() for r in rows] == [[0, 6], [0, 3]]  # never [0, 6, 6]
    assert report.rows == 2 and report.packed_conversations == 2


def test_a_row_that_does_not_fill_keeps_every_conversation_whole():
    rows, _ = pack_conversations(_conversations([4, 3]), 6)
    assert [r["packed_cu_seqlens"].tolist() for r in rows] == [[0, 4], [0, 3]]  # B is not cut to [0, 4, 6]


def test_row_fields_of_the_seed_example():
    rows, _ = pack_conversations([([5, 6, 7, 8], [1, 1, 1, 1]), ([9, 10, 11], [0, 1, 1])], 7)
    (row,) = rows
    assert row["input_ids"].tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert row["target_ids"].tolist() == [6, 7, 8, 0, 10, 11, 0]
    assert row["token_mask"].tolist() == [1, 1, 1, 0, 1, 1, 0]  # 0 on each conversation's last token
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert row["packed_cu_seqlens"].tolist() == [0, 4, 7]


streams = st.tuples(
    st.sampled_from([1, 2, 4]),  # alignment (cp 1, cp 1 with tp 2, cp 2)
    st.integers(1, 6),  # pack length in units of the alignment
).flatmap(
    lambda al: st.tuples(
        st.just(al[0]),
        st.just(al[0] * al[1]),
        # many lengths that divide the pack exactly, so exact fills are frequent, plus overflows
        st.lists(st.one_of(st.sampled_from([al[0] * al[1], al[0], 1]), st.integers(0, 3 * al[0] * al[1])), max_size=30),
        st.sampled_from(["split", "reject"]),
    )
)


@given(streams)
def test_random_streams_lose_nothing_repeat_nothing_and_every_row_is_valid(case):
    alignment, pack_length, lengths, overflow = case
    convs = _conversations(lengths)
    rows, report = pack_conversations(convs, pack_length, alignment=alignment, pad_token_id=PAD, overflow=overflow)
    for r in rows:
        assert (np.diff(r["packed_cu_seqlens"]) > 0).all()  # no zero-length segment
        assert (np.diff(r["packed_cu_seqlens"]) % alignment == 0).all()
        assert len(r["input_ids"]) <= pack_length
    kept = [c for k, c in enumerate(convs) if k not in report.rejected_too_long]
    assert _real_tokens(rows) == [t for ids, _ in kept for t in ids]  # order kept, nothing lost or repeated
    assert report.rejected_empty == [k for k, n in enumerate(lengths) if n == 0]
    too_long = [k for k, n in enumerate(lengths) if -(-n // alignment) * alignment > pack_length]
    assert (report.split if overflow == "split" else report.rejected_too_long) == too_long
    if rows:
        validate_columns(Columns.from_rows(rows), pack_length=pack_length, alignment=alignment)


@settings(max_examples=25)
@given(streams, st.sampled_from(sorted(ALGORITHMS)))
def test_packed_files_round_trip_every_row_exactly(case, algorithm):
    alignment, pack_length, lengths, overflow = case
    convs = [([t % 256 for t in ids], mask) for ids, mask in _conversations(lengths)]
    rows, report = pack_conversations(
        convs, pack_length, alignment=alignment, pad_token_id=BYTES.pad_token_id, overflow=overflow, algorithm=algorithm
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.parquet"
        write_packed(
            path,
            rows,
            pack_length=pack_length,
            tokenizer=BYTES.identity,
            pad_token_id=BYTES.pad_token_id,
            alignment=alignment,
            report=report.summary(),
        )
        packed = read_packed(path, tokenizer=BYTES.identity)
        assert len(packed) == len(rows) and packed.metadata["report"] == report.summary()
        for i, row in enumerate(rows):
            assert all(packed[i][f].tolist() == row[f].tolist() for f in row)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_keeps_every_conversation(algorithm):
    lengths = [3, 8, 1, 5, 8, 2, 7, 4, 4]
    rows, report = pack_conversations(_conversations(lengths), 8, pad_token_id=PAD, algorithm=algorithm)
    assert sorted(_real_tokens(rows)) == list(range(sum(lengths)))
    assert report.rows == len(rows) <= len(lengths)


def test_overflow_policies_are_explicit_and_counted():
    convs = _conversations([3, 10, 2])
    rows, report = pack_conversations(convs, 4, overflow="reject")
    assert report.rejected_too_long == [1] and report.summary()["rejected_too_long"] == 1
    rows, report = pack_conversations(convs, 4, overflow="split")
    assert report.split == [1] and report.split_pieces == 3
    with pytest.raises(ValueError, match="overflow"):
        pack_conversations(convs, 4, overflow="truncate")
    with pytest.raises(ValueError, match="pack_length"):
        pack_conversations(convs, 6, alignment=4)


# ---- packed files ------------------------------------------------------------------------------
def _write(tmp_path, lengths=(6, 3, 5, 2, 7), pack_length=8, alignment=1):
    convs = [([t % 250 for t in ids], mask) for ids, mask in _conversations(lengths)]
    rows, report = pack_conversations(convs, pack_length, alignment=alignment, pad_token_id=BYTES.pad_token_id)
    path = tmp_path / "packed.parquet"
    write_packed(
        path,
        rows,
        pack_length=pack_length,
        tokenizer=BYTES.identity,
        pad_token_id=BYTES.pad_token_id,
        alignment=alignment,
        report=report.summary(),
    )
    return path, rows


def _rewrite(path, edit):
    """Rewrite the file with ``edit(columns as lists)`` applied, keeping the original metadata."""
    table = pq.read_table(path)
    cols = {name: table.column(name).to_pylist() for name in table.column_names}
    edit(cols)
    new = pa.table({k: pa.array(v, type=pa.list_(pa.int32())) for k, v in cols.items()})
    pq.write_table(new.replace_schema_metadata(table.schema.metadata), path)


def test_files_are_zstd_with_dictionaries_only_where_values_are_small(tmp_path):
    """A dictionary over the id columns made writing 3x slower; over masks, positions and boundaries
    it is cheap and small. (pyarrow silently ignores a dictionary column name that is not a leaf.)"""
    path, _ = _write(tmp_path)
    group = pq.ParquetFile(path).metadata.row_group(0)
    chunks = {group.column(i).path_in_schema.split(".")[0]: group.column(i) for i in range(group.num_columns)}
    assert {f: "RLE_DICTIONARY" in c.encodings for f, c in chunks.items()} == {
        "input_ids": False,
        "target_ids": False,
        "token_mask": True,
        "position_ids": True,
        "packed_cu_seqlens": True,
    }
    assert {c.compression for c in chunks.values()} == {"ZSTD"}


def test_file_round_trip_and_metadata(tmp_path):
    path, rows = _write(tmp_path, alignment=2)
    packed = read_packed(path, tokenizer=BYTES.identity)
    assert len(packed) == len(rows)
    for i, r in enumerate(rows):
        assert all(np.array_equal(packed[i][f], r[f]) for f in r)
    meta = packed.metadata
    assert meta["pack_length"] == 8 and meta["alignment"] == 2 and meta["format_version"] == 2
    assert meta["tokenizer"]["name"] == "nopad-byte-v1" and len(meta["tokenizer"]["vocab_hash"]) == 64
    assert 0 < packed.utilisation <= 1


def test_a_tampered_boundary_is_refused_naming_the_row(tmp_path):
    path, _ = _write(tmp_path)
    _rewrite(path, lambda c: c["packed_cu_seqlens"].__setitem__(1, [0, 2, 2, c["packed_cu_seqlens"][1][-1]]))
    with pytest.raises(ValueError, match=r"packed_cu_seqlens row 1: expected boundaries rising strictly"):
        read_packed(path)


def test_a_truncated_row_is_refused_naming_the_row(tmp_path):
    path, _ = _write(tmp_path)
    _rewrite(path, lambda c: c["input_ids"].__setitem__(2, c["input_ids"][2][:-1]))
    with pytest.raises(ValueError, match=r"row 2: expected as many entries as input_ids"):
        read_packed(path)


def test_a_file_from_another_tokenizer_is_refused(tmp_path):
    path, _ = _write(tmp_path)
    other = TokenizerIdentity("nopad-byte-v1", "0" * 64, BYTES.identity.vocab_size)
    with pytest.raises(ValueError, match="another tokenizer: tokenizer vocab_hash"):
        read_packed(path, tokenizer=other)


def test_an_edit_that_keeps_rows_well_formed_is_caught_by_the_checksum(tmp_path):
    path, _ = _write(tmp_path)
    # change the label of a masked-out slot: structurally fine, but not the file that was written
    _rewrite(path, lambda c: c["target_ids"][0].__setitem__(-1, 7))
    with pytest.raises(ValueError, match="rows_checksum"):
        read_packed(path)


def test_a_label_that_is_not_the_next_token_is_refused(tmp_path):
    path, _ = _write(tmp_path)
    _rewrite(path, lambda c: c["target_ids"][0].__setitem__(0, c["target_ids"][0][0] + 1))
    with pytest.raises(ValueError, match=r"target_ids row 0: expected the next input id"):
        read_packed(path)


def test_a_parquet_file_without_metadata_is_refused(tmp_path):
    path = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"input_ids": [[1, 2]]}), path)
    with pytest.raises(ValueError, match="metadata"):
        read_packed(path)


# ---- collate -----------------------------------------------------------------------------------
def test_collate_pads_boundaries_with_minus_one_and_counts_them():
    rows, _ = pack_conversations([([5, 6, 7, 8], [1] * 4), ([9, 10, 11], [1] * 3), ([1, 2], [1, 1])], 7)
    batch = collate_packed(rows, pad_token_id=0)
    assert batch.batch_size == torch.Size([2]) and batch["input_ids"].shape == (2, 7)
    assert batch["packed_cu_seqlens"].tolist() == [[0, 4, 7], [0, 2, -1]]
    assert batch["packed_cu_seqlens_lengths"].tolist() == [3, 2]
    assert batch["packed_max_seqlen"].tolist() == [4, 2]
    assert batch["input_ids"][1].tolist() == [1, 2, 0, 0, 0, 0, 0]
    assert batch["token_mask"][1].tolist() == [1, 0, 0, 0, 0, 0, 0]


def test_collate_refuses_a_mix_of_packed_and_unpacked_rows():
    rows, _ = pack_conversations(_conversations([3, 4]), 4)
    unpacked = {k: v for k, v in rows[0].items() if k != "packed_cu_seqlens"}
    with pytest.raises(ValueError, match=r"a mix of packed and unpacked rows: rows \[1\]"):
        collate_packed([rows[0], unpacked])


def test_collate_refuses_a_repeated_boundary():
    rows, _ = pack_conversations(_conversations([6]), 6)
    bad = dict(rows[0], packed_cu_seqlens=np.array([0, 6, 6]))
    with pytest.raises(ValueError, match="packed_cu_seqlens row 0"):
        collate_packed([bad])


# ---- tokenizers and the CLI --------------------------------------------------------------------
def test_records_are_encoded_with_the_documented_masks():
    ids, mask = encode_record({"input_ids": [1, 2, 3]}, BYTES)
    assert (ids, mask) == ([1, 2, 3], [1, 1, 1])
    ids, mask = encode_record({"text": "ab"}, BYTES)
    assert ids == [97, 98, BYTES.eos_token_id] and mask == [1, 1, 1]
    ids, mask = encode_record(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, BYTES
    )
    assert BYTES.decode(ids) == "<|user|>\nq\n<|assistant|>\na\n"
    assert [BYTES.decode([i]) for i, m in zip(ids, mask) if m] == ["a", "\n", ""]  # the answer, its newline, eos
    with pytest.raises(ValueError, match="record line 3: expected input_ids in"):
        encode_record({"input_ids": [1, 999]}, BYTES, line=3)
    with pytest.raises(ValueError, match="expected a key"):
        encode_record({"prompt": "x"}, BYTES)


def _jsonl(tmp_path, records):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_cli_pack_then_inspect(tmp_path, capsys):
    src = _jsonl(
        tmp_path,
        [
            {"input_ids": [1, 2, 3, 4, 5, 6]},
            {"input_ids": [7, 8, 9], "loss_mask": [0, 1, 1]},
            {"text": "a longer text than one pack holds"},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        ],
    )
    out = tmp_path / "out.parquet"
    assert main(["pack", str(src), "-o", str(out), "--pack-length", "16", "--cp-size", "2", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "split (conversation numbers, 0-based input order): [2, 3]" in printed
    packed = read_packed(out, tokenizer=load_tokenizer().identity)
    assert packed.metadata["alignment"] == 4 and packed.metadata["report"]["split"] == 2
    assert main(["inspect", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "validation: OK" in printed and f"rows: {len(packed)}" in printed and "histogram" in printed
    assert (
        main(
            [
                "pack",
                str(src),
                "-o",
                str(tmp_path / "r.parquet"),
                "--pack-length",
                "16",
                "--overflow",
                "reject",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "rejected as too long (conversation numbers, 0-based input order): [2, 3]" in capsys.readouterr().out


def test_cli_inspect_fails_on_a_tampered_file(tmp_path, capsys):
    path, _ = _write(tmp_path)
    _rewrite(path, lambda c: c["position_ids"][0].__setitem__(1, 5))
    assert main(["inspect", str(path)]) != 0
    assert "validation: FAILED" in capsys.readouterr().out


def test_cli_pack_reports_bad_input_and_exits_non_zero(tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"input_ids": [1, 2]}\nnot json\n')
    assert main(["pack", str(src), "-o", str(tmp_path / "o.parquet"), "--pack-length", "8", "--no-progress"]) == 2
    assert "line 2" in capsys.readouterr().err


def _save_local_hf_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "hello": 3, "world": 4, "<|user|>": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(directory)


def test_cli_with_a_local_hf_tokenizer_and_refusing_the_other_one(tmp_path, capsys):
    tok_dir = tmp_path / "tiny-tok"
    _save_local_hf_tokenizer(tok_dir)
    src = _jsonl(tmp_path, [{"text": "hello world"}, {"text": "world hello hello"}])
    out = tmp_path / "hf.parquet"
    assert (
        main(["pack", str(src), "-o", str(out), "--pack-length", "8", "--tokenizer", str(tok_dir), "--no-progress"])
        == 0
    )
    packed = read_packed(out, tokenizer=load_tokenizer(tok_dir).identity)
    assert packed[0]["input_ids"].tolist() == [3, 4, 1, 4, 3, 3, 1]  # "hello world" eos "world hello hello" eos
    capsys.readouterr()
    assert main(["inspect", str(out), "--tokenizer", "bytes"]) == 1
    assert "another tokenizer" in capsys.readouterr().out
    with pytest.raises(ValueError, match="local directory"):
        load_tokenizer(tmp_path / "missing")


# ---- the vectorised packer against a per-conversation loop --------------------------------------
def _reference_pack(convs, pack_length, *, alignment, pad, overflow, algorithm):
    """The textbook packer, one conversation and one row at a time in plain Python lists."""
    report = {"split": [], "split_pieces": 0, "rejected_too_long": [], "rejected_empty": []}
    pieces = []
    for k, (ids, mask) in enumerate(convs):
        ids, mask = [int(t) for t in ids], [int(m) for m in mask]
        if not ids:
            report["rejected_empty"].append(k)
        elif len(ids) <= pack_length:
            pieces.append((ids, mask))
        elif overflow == "reject":
            report["rejected_too_long"].append(k)
        else:
            report["split"].append(k)
            cuts = range(0, len(ids), pack_length)
            report["split_pieces"] += len(cuts)
            pieces += [(ids[s : s + pack_length], mask[s : s + pack_length]) for s in cuts]
    padded = [-(-len(ids) // alignment) * alignment for ids, _ in pieces]
    rows = []
    for b in pack_lengths(padded, pack_length, algorithm=algorithm):
        row = {"input_ids": [], "target_ids": [], "token_mask": [], "position_ids": [], "packed_cu_seqlens": [0]}
        for i in sorted(b):
            (ids, mask), spare = pieces[i], padded[i] - len(pieces[i][0])
            row["input_ids"] += ids + [pad] * spare
            row["target_ids"] += ids[1:] + [pad] * (spare + 1)
            row["token_mask"] += mask[1:] + [0] * (spare + 1)
            row["position_ids"] += list(range(padded[i]))
            row["packed_cu_seqlens"].append(row["packed_cu_seqlens"][-1] + padded[i])
        rows.append(row)
    report |= {
        "conversations": len(convs),
        "rows": len(rows),
        "packed_conversations": len(pieces),
        "real_tokens": sum(len(ids) for ids, _ in pieces),
        "row_tokens": sum(padded),
    }
    return rows, report


def _random_conversations(lengths, seed, as_arrays):
    rng = np.random.default_rng(seed)
    convs = [(rng.integers(0, 300, n), rng.integers(0, 2, n)) for n in lengths]
    return convs if as_arrays else [(ids.tolist(), mask.tolist()) for ids, mask in convs]


packings = st.tuples(
    st.sampled_from([1, 2, 4, 8]),  # alignment
    st.integers(1, 6),  # pack length in units of the alignment
    st.sampled_from(sorted(ALGORITHMS)),
    st.sampled_from(["split", "reject"]),
    st.booleans(),  # numpy arrays or lists
    st.integers(0, 2**16),  # seed of the token ids and masks
).flatmap(
    lambda p: st.tuples(
        st.just(p),
        # lengths around the pack length and the alignment, so exact fills, padding and overflow are frequent
        st.lists(st.one_of(st.integers(0, 3 * p[0] * p[1]), st.sampled_from([p[0] * p[1], p[0], 1])), max_size=40),
    )
)


@given(packings)
def test_rows_equal_a_per_conversation_loop_field_by_field(case):
    (alignment, units, algorithm, overflow, as_arrays, seed), lengths = case
    pack_length = alignment * units
    convs = _random_conversations(lengths, seed, as_arrays)
    copies = [(np.array(ids), np.array(mask)) for ids, mask in convs]
    options = dict(alignment=alignment, pad=PAD, overflow=overflow, algorithm=algorithm)
    want_rows, want_report = _reference_pack(convs, pack_length, **options)
    rows, report = pack_conversations(
        iter(convs), pack_length, alignment=alignment, pad_token_id=PAD, overflow=overflow, algorithm=algorithm
    )
    assert len(rows) == len(want_rows)
    for row, want in zip(rows, want_rows):
        assert set(row) == set(want)
        for f, values in row.items():
            assert values.dtype == np.int64 and values.tolist() == want[f], f
    got_report = {k: getattr(report, k) for k in want_report}
    assert got_report == want_report
    assert all(np.array_equal(a, b) and np.array_equal(m, n) for (a, m), (b, n) in zip(convs, copies))  # unchanged


@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.int64])
def test_arrays_of_any_integer_width_and_boolean_masks_give_the_same_rows(dtype):
    lengths = [5, 3, 9, 1, 4]
    lists = _random_conversations(lengths, 0, as_arrays=False)
    arrays = [(np.asarray(ids, dtype=dtype), np.asarray(mask, dtype=bool)) for ids, mask in lists]
    want, _ = pack_conversations(lists, 9, alignment=1, algorithm="best_fit_decreasing")
    rows, _ = pack_conversations(arrays, 9, alignment=1, algorithm="best_fit_decreasing")
    as_lists = lambda rows: [{f: v.tolist() for f, v in r.items()} for r in rows]  # noqa: E731
    assert as_lists(rows) == as_lists(want)


def test_no_conversation_gives_no_row():
    rows, report = pack_conversations([], 8)
    assert rows == [] and report.rows == 0 and report.conversations == 0
    rows, report = pack_conversations([([], []), ([1] * 9, [1] * 9)], 8, overflow="reject")
    assert rows == [] and report.rejected_empty == [0] and report.rejected_too_long == [1]


def test_a_row_can_be_edited_without_touching_the_others():
    rows, _ = pack_conversations(_conversations([3, 3, 3]), 6)
    rows[0]["token_mask"][:] = 0
    assert rows[1]["token_mask"].tolist() == [1, 1, 0]


# ---- bad input: refused naming the conversation and what to fix --------------------------------
GOOD = ([1, 2, 3], [0, 1, 1])
NOT_IDS = "input_ids conversation 1: expected a 1-D sequence of integer token ids"


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (([1, 2, 3], [1, 1]), r"loss_mask conversation 1: expected 3 entries like ids, got 2"),
        (([1, 2, 3], [0, 2, 1]), r"loss_mask conversation 1: expected only 0 and 1, got 2"),
        (([1, 2, 3], [0, -1, 1]), r"loss_mask conversation 1: expected only 0 and 1, got -1"),
        (([1, 2, 3], [1.0, 1.0, 0.0]), r"loss_mask conversation 1: expected a 1-D sequence of 0 and 1, got .*float"),
        (([1, 2.5, 3], [1, 1, 1]), rf"{NOT_IDS}, got shape \(3,\) dtype float64"),
        ((["a", "b"], [1, 1]), rf"{NOT_IDS}, got shape \(2,\) dtype <U1"),
        (([1, 2**70], [1, 1]), rf"{NOT_IDS}, got shape \(2,\) dtype object"),
        (([[1, 2], [3, 4]], [1, 1]), r"input_ids conversation 1: expected a 1-D sequence .*, got shape \(2, 2\)"),
        ((None, [1]), rf"{NOT_IDS}, got NoneType"),
        ((np.array(7), [1]), rf"{NOT_IDS}, got ndarray"),
        (([1, 2], [1, 1], [1, 1]), r"conversation 1: expected an \(ids, loss_mask\) pair, got tuple of 3"),
        (7, r"conversation 1: expected an \(ids, loss_mask\) pair, got int"),
    ],
)
@pytest.mark.parametrize("algorithm", ["concatenative", "best_fit_decreasing"])
def test_a_bad_conversation_is_refused_naming_it(bad, match, algorithm):
    with pytest.raises(ValueError, match=match):
        pack_conversations([GOOD, bad, GOOD], 8, algorithm=algorithm)


def _one_field_off(case):
    """A valid batch of conversations with one conversation changed in one way, and the error to expect."""
    lengths, victim, kind, seed = case
    convs = _random_conversations(lengths, seed, as_arrays=seed % 2 == 0)
    k = victim % len(convs)
    ids, mask = convs[k]
    ids, mask = list(ids), list(mask)
    n = len(ids)
    if kind == "mask_short":
        convs[k] = (ids, mask[:-1])
        return convs, rf"loss_mask conversation {k}: expected {n} entries like ids, got {n - 1}"
    if kind == "mask_long":
        convs[k] = (ids, mask + [1])
        return convs, rf"loss_mask conversation {k}: expected {n} entries like ids, got {n + 1}"
    if kind == "mask_value":
        mask[seed % n] = 2 if seed % 3 else -1
        convs[k] = (ids, mask)
        return convs, rf"loss_mask conversation {k}: expected only 0 and 1, got -?[12]"
    if kind == "float_id":
        ids[seed % n] = ids[seed % n] + 0.5
        convs[k] = (ids, mask)
        return convs, rf"input_ids conversation {k}: expected a 1-D sequence of integer token ids"
    convs[k] = (ids, mask, mask)  # not a pair
    return convs, rf"conversation {k}: expected an \(ids, loss_mask\) pair"


near_valid = st.tuples(
    st.lists(st.integers(1, 12), min_size=1, max_size=12),  # every conversation fits: none is rejected unread
    st.integers(0, 100),
    st.sampled_from(["mask_short", "mask_long", "mask_value", "float_id", "not_a_pair"]),
    st.integers(0, 2**16),
)


@given(near_valid, st.sampled_from(sorted(ALGORITHMS)), st.sampled_from([1, 2, 4]))
def test_a_conversation_one_field_off_is_refused_naming_it(case, algorithm, alignment):
    convs, match = _one_field_off(case)
    with pytest.raises(ValueError, match=match):
        pack_conversations(convs, 12 * alignment, alignment=alignment, algorithm=algorithm)


# ---- validation over many blocks of tokens: the first bad token names its row ------------------
def _many_rows():
    """About 200,000 tokens in rows of 4096 (the per-token checks run in blocks of 65,536)."""
    rng = np.random.default_rng(0)
    convs = [(rng.integers(1, 250, n), rng.integers(0, 2, n)) for n in rng.integers(1, 2000, 200)]
    rows, _ = pack_conversations(convs, 4096, alignment=2, algorithm="best_fit_decreasing")
    return Columns.from_rows(rows)


def _inside(cols, row, from_end):
    """A flat token index in ``row``: ``from_end`` tokens before the end of the row's first conversation."""
    start = int(cols.offsets["input_ids"][row])
    return start + int(cols.row(row)["packed_cu_seqlens"][1]) - from_end


def _wrong_label(cols, t):
    cols.values["token_mask"][t] = 1
    cols.values["target_ids"][t] = cols.values["input_ids"][t + 1] % 200 + 1  # another id, in the vocabulary


TAMPERS = {
    "position_ids at a conversation's start": (
        lambda c, r: c.values["position_ids"].__setitem__(int(c.offsets["position_ids"][r]), 1),
        r"position_ids row {row}: expected 0, 1, \.\.\. restarting",
    ),
    "position_ids inside a conversation": (
        lambda c, r: c.values["position_ids"].__setitem__(_inside(c, r, 1), 0),
        r"position_ids row {row}: expected 0, 1, \.\.\. restarting",
    ),
    "token_mask 2": (
        lambda c, r: c.values["token_mask"].__setitem__(_inside(c, r, 2), 2),
        r"token_mask row {row}: expected only 0 and 1",
    ),
    "token_mask -1": (
        lambda c, r: c.values["token_mask"].__setitem__(_inside(c, r, 2), -1),
        r"token_mask row {row}: expected only 0 and 1",
    ),
    "token_mask 1 on a conversation's last token": (
        lambda c, r: c.values["token_mask"].__setitem__(_inside(c, r, 1), 1),
        r"token_mask row {row}: expected 0 on the last token",
    ),
    "a counted label that is not the next id": (
        lambda c, r: _wrong_label(c, _inside(c, r, 3)),
        r"target_ids row {row}: expected the next input id",
    ),
    "input id out of the vocabulary": (
        lambda c, r: c.values["input_ids"].__setitem__(_inside(c, r, 2), 256),
        r"input_ids row {row}: expected token ids in \[0, 256\)",
    ),
    "negative target id": (
        lambda c, r: c.values["target_ids"].__setitem__(_inside(c, r, 2), -5),
        r"target_ids row {row}: expected token ids in \[0, 256\)",
    ),
}


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
@pytest.mark.parametrize("where", [0, 0.5, -1])  # first row, a middle one, the last
def test_validation_names_the_row_of_a_bad_token_in_any_block(tamper, where):
    cols = _many_rows()
    assert cols.row_lengths.sum() > 3 * 65_536
    validate_columns(cols, pack_length=4096, alignment=2, vocab_size=256)
    row = int(where * (cols.num_rows - 1)) if where >= 0 else cols.num_rows - 1
    edit, match = TAMPERS[tamper]
    edit(cols, row)
    with pytest.raises(ValueError, match=match.format(row=row)):
        validate_columns(cols, pack_length=4096, alignment=2, vocab_size=256)


@settings(max_examples=25)
@given(st.integers(0, 10**9), st.sampled_from(sorted(TAMPERS)))
def test_validation_finds_a_bad_token_wherever_it_is(seed, tamper):
    cols = _many_rows()
    row = seed % cols.num_rows
    edit, match = TAMPERS[tamper]
    edit(cols, row)
    with pytest.raises(ValueError, match=match.format(row=row)):
        validate_columns(cols, pack_length=4096, alignment=2, vocab_size=256)


@pytest.mark.parametrize("edge", [65_535, 65_536, 65_537])
def test_conversations_meeting_at_a_block_edge_pass_and_a_bad_position_there_is_found(edge):
    convs = _conversations([edge, 3, 65_536 * 2 - edge - 3, 5])  # boundaries at, and 3 past, the edge
    rows, _ = pack_conversations(convs, 2 * 65_536)
    cols = Columns.from_rows(rows)
    validate_columns(cols, pack_length=2 * 65_536)
    for t in (edge - 1, edge, edge + 1):
        bad = Columns({f: v.copy() for f, v in cols.values.items()}, cols.offsets)
        bad.values["position_ids"][t] += 1
        with pytest.raises(ValueError, match=r"position_ids row 0: expected 0, 1, \.\.\. restarting"):
            validate_columns(bad, pack_length=2 * 65_536)
