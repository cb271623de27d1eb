"""Reads a W&B offline log (`run-ID.wandb`) for tests: what `wandb sync` would send. W&B writes it
as a LevelDB-style log (32 KiB blocks of records, each a 7-byte header: CRC, length, kind; a record
longer than a block continues in the next) after a 7-byte header of its own (":W&B", a magic number,
a version), each record one protobuf `Record`. Not a public interface: written from the format as
W&B 0.31 writes it, for tests only."""

from __future__ import annotations

import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B log"
    pos, parts, out = HEADER, b"", []
    while pos + HEADER <= len(data):
        room = BLOCK - pos % BLOCK
        if room < HEADER:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        body = data[pos + HEADER : pos + HEADER + length]
        if kind == 0 or len(body) < length:  # zeros: the rest of the block; short: a record cut by a kill
            pos += room if kind == 0 else len(data)
            continue
        pos += HEADER + length
        parts = body if kind in (FULL, FIRST) else parts + body
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
    return out


def history_steps(path: Path) -> list[int]:
    """The step of each history row in the log, in order."""
    return [r.history.step.num for r in records(path) if r.WhichOneof("record_type") == "history"]


def exit_codes(path: Path) -> list[int]:
    return [r.exit.exit_code for r in records(path) if r.WhichOneof("record_type") == "exit"]
