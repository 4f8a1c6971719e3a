"""Pack a few conversations offline, write and reopen the Parquet file, and print rows and THD shards.

python examples/pack_offline.py
"""

import tempfile
from pathlib import Path

from nopad.packing import (
    ByteTokenizer,
    encode_record,
    pack_conversations,
    packed_to_thd,
    read_packed,
    thd_alignment,
    write_packed,
)

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    {"text": "short"},
    {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "loss_mask": [0, 0, 0, 1, 1, 1, 1, 1]},
    {"text": "a conversation longer than one pack gets split into pieces"},
]


def main() -> None:
    tokenizer = ByteTokenizer()
    cp_size, pack_length = 2, 32
    alignment = thd_alignment(cp_size=cp_size)
    records = (encode_record(r, tokenizer) for r in CONVERSATIONS)
    rows, report = pack_conversations(records, pack_length, alignment=alignment, pad_token_id=tokenizer.pad_token_id)
    print("report:", report.summary())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "packed.parquet"
        write_packed(
            path,
            rows,
            pack_length=pack_length,
            tokenizer=tokenizer.identity,
            pad_token_id=tokenizer.pad_token_id,
            alignment=alignment,
            cp_size=cp_size,
        )
        packed = read_packed(path, tokenizer=tokenizer.identity)  # validates every row
        for i in range(len(packed)):
            row = packed[i]
            print(f"row {i}: cu_seqlens {row['packed_cu_seqlens'].tolist()}")
            print(f"  text     {tokenizer.decode(row['input_ids'].tolist())!r}")
            print(f"  mask     {''.join(map(str, row['token_mask'].tolist()))}")
        batch = packed.batch(range(len(packed)))
        for rank in range(cp_size):
            thd = packed_to_thd(batch, cp_size=cp_size, cp_rank=rank)
            print(
                f"cp rank {rank}: tokens {tuple(thd.tokens.shape)}, "
                f"cu_seqlens {thd.packed_seq_params.cu_seqlens_q.tolist()}"
            )


if __name__ == "__main__":
    main()
