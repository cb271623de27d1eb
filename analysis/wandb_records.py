"""Runs from W&B: an online project through the public API, or offline run folders
(`wandb/offline-run-*`) read straight from their `.wandb` transaction log, no network, no login.
Both give the rows the trainer logged (as `train/<field>` and `eval/<field>`) and the summary it
wrote at the end; `records.make_run` checks them like the JSONL records."""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

from .records import RecordError, Run, make_run

# The `.wandb` file is a LevelDB-style log: a 7-byte file header, then 32 KiB blocks of records,
# each with a 7-byte header (crc32, length, type); a protobuf may span blocks (FIRST/MIDDLE/LAST).
_FILE_HEADER = struct.Struct("<4sHB")
_RECORD_HEADER = struct.Struct("<IHB")
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


# The versions of wandb whose offline logs this reader was tested on (pyproject pins wandb to them);
# another may change the log and is refused with both versions named, not misread.
TESTED_WANDB = "0.19.11, 0.31.0"
_LOG_VERSION = 0


def _payloads(data: bytes, name: str):
    ident, magic, version = _FILE_HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1:
        raise RecordError(name, "not a W&B transaction log (bad header)")
    if version != _LOG_VERSION:
        raise FormatError(name, f"log format version {version}, this reader knows version {_LOG_VERSION}")
    pos, pending = _FILE_HEADER.size, b""
    while pos + _RECORD_HEADER.size <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _RECORD_HEADER.size:  # block tail too small for a header: zero padding
            pos += room
            continue
        crc, length, kind = _RECORD_HEADER.unpack_from(data, pos)
        if (crc, length, kind) == (0, 0, 0):
            break  # unused space at the end of a log that is still open (or was killed)
        chunk = data[pos + _RECORD_HEADER.size: pos + _RECORD_HEADER.size + length]
        if len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            break  # a torn write: keep what came before, like W&B's own reader
        pos += _RECORD_HEADER.size + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _split_row(flat: dict) -> list[dict]:
    """One W&B history row may hold a training step and the eval at that step: split them back."""
    step = flat.get("_step")
    rows = []
    for split in ("train", "eval"):
        fields = {k[len(split) + 1:]: v for k, v in flat.items() if k.startswith(split + "/")}
        if fields:
            rows.append({"step": step, **fields, **({"split": "eval"} if split == "eval" else {})})
    return rows


class FormatError(RecordError):
    """A `.wandb` log this reader cannot read; the message names the wandb versions involved."""

    def __init__(self, run: str, problem: str, producer: str | None = None):
        from importlib.metadata import version

        wrote = f"written by wandb {producer}; " if producer else ""
        super().__init__(run, f"cannot read this W&B log ({problem}; {wrote}wandb {version('wandb')} installed; "
                              f"the reader is tested with wandb {TESTED_WANDB}): read the run's metrics.jsonl "
                              f"and summary.json instead")


def records(folder: Path, name: str | None = None):
    """The protobuf records of a `wandb/offline-run-*` (or synced `run-*`) folder's log, in order."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    name = name or str(folder)
    logs = sorted(Path(folder).glob("*.wandb"))
    if not logs:
        raise RecordError(name, "no .wandb file in this W&B run folder")
    producer = None
    for payload in _payloads(logs[0].read_bytes(), name):
        record = pb.Record()
        try:
            record.ParseFromString(payload)
        except DecodeError as e:
            raise FormatError(name, f"a record does not parse: {e}", producer) from None
        if record.WhichOneof("record_type") == "header":
            producer = record.header.version_info.producer.split("+")[0] or None
        yield record


def run_record(folder: Path):
    """The run's own record (id, group, job type, tags, ...): wandb_internal_pb2.RunRecord."""
    for record in records(folder):
        if record.WhichOneof("record_type") == "run":
            return record.run
    raise RecordError(str(folder), "no run record in this W&B log")


def read_offline(folder: Path, name: str | None = None) -> Run:
    """A `wandb/offline-run-*` (or synced `run-*`) folder."""
    folder = Path(folder)
    name = name or str(folder)
    rows, summary, config, exited = [], {}, {}, False
    for record in records(folder, name):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows += _split_row({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                if item.key and not item.key.startswith("_"):  # top-level keys: the run's summary
                    summary[item.key] = json.loads(item.value_json)
        elif kind == "run":
            config = {i.key: json.loads(i.value_json) for i in record.run.config.update}
        elif kind == "exit":
            exited = True
    finished = exited and "train_time_s" in summary
    return make_run(name, summary if finished else None, rows, config, source="wandb-offline",
                    summary_name="final W&B summary")


def is_offline_folder(path: Path) -> bool:
    return path.is_dir() and any(path.glob("run-*.wandb"))


def read_project(project: str) -> tuple[list[Run], list[str]]:
    """Every run of an online project ("entity/project"), through the public API (needs network
    and a W&B login). Returns the healthy runs and one message per unusable run."""
    import wandb

    runs, problems = [], []
    for remote in wandb.Api().runs(project):
        name = f"wandb:{project}/{remote.id} ({remote.name})"
        try:
            rows = [r for flat in remote.scan_history() for r in _split_row(flat)]
            summary = dict(remote.summary) if remote.state == "finished" else None
            if summary is not None and "train_time_s" not in summary:
                summary = None
            runs.append(make_run(name, summary, rows, dict(remote.config), source="wandb-online",
                                 summary_name="final W&B summary"))
        except RecordError as e:
            problems.append(str(e))
    return runs, problems
