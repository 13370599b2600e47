"""The history rows of W&B's offline run files (``run-<id>.wandb``), read without a W&B server."""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32768, 7  # W&B writes LevelDB's log format: 32 KiB blocks of records, each after a 7-byte header


def records(path: Path):
    """Every record of one ``.wandb`` file, as W&B's ``Record`` protobuf."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    position, pieces = 7, b""
    while position + HEADER <= len(data):
        left = BLOCK - position % BLOCK
        if left < HEADER:  # the rest of a block too short for a header is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + HEADER])
        pieces += data[position + HEADER:position + HEADER + length]
        position += HEADER + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            yield record
            pieces = b""
        elif kind == 0:
            break


def history(path: Path) -> list[dict]:
    """The rows a W&B run logged, each a dict of key -> value."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in records(path) if record.WhichOneof("record_type") == "history"]
