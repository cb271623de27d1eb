"""Behaviour pinned before the redesign (issue 32): a fixed set of short runs whose records are
committed in tests/golden/records.json. Each run's deterministic records (losses, learning rates,
what aggregated, bytes and collectives per mesh dimension, evaluations) must equal the stored ones
bit for bit on a machine whose torch and CPU kernels are those that wrote them; elsewhere within
1e-5 relative, since another kernel set may sum in another order.

Regenerate (only when a change of behaviour is intended, and say why in the commit):
    FLDP_GOLDEN_WRITE=1 python -m pytest tests/test_golden.py -n 0
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from conftest import cli, compose_cfg, train_world

GOLDEN = Path(__file__).parent / "golden" / "records.json"
WRITE = os.environ.get("FLDP_GOLDEN_WRITE") == "1"

SHORT = ["trainer.steps=8", "trainer.eval_every=4"]
BUCKETS = "algorithm.fedavg.bucket_mb=0.05"  # several buckets per fragment
# name -> overrides; every run is 8 steps, evaluated at step 4 and at the end
CASES = {
    "fsdp": ["algorithm=fsdp", "topology=local_2"],
    "hsdp_bf16": ["algorithm=hsdp", "topology=local_4", "trainer.precision=bf16"],
    "fl_fsdp": ["algorithm=fl_fsdp", "topology=local_4", "algorithm.every=2"],
    "fl_hsdp": ["algorithm=fl_hsdp", "topology=local_4", "algorithm.every=4"],
    "fl_hsdp_all_replicas": [
        "algorithm=fl_hsdp",
        "topology=local_8",
        "algorithm.every=4",
        "algorithm.fedavg.mode=all_replicas",
    ],
    "diloco": ["algorithm=diloco_hsdp", "topology=local_4", "algorithm.every=2"],
    "fedadam": ["algorithm=fl_fsdp", "topology=local_4", "algorithm.every=2", "algorithm.outer.name=adam"],
    "streaming_overlap": [
        "algorithm=diloco_hsdp",
        "topology=local_4",
        "algorithm.every=4",
        "algorithm.streaming.fragments=2",
        "algorithm.streaming.overlap=1",
        "algorithm.streaming.alpha=0.5",
    ],
    "quantised": [
        "algorithm=fl_fsdp",
        "topology=local_4",
        "algorithm.every=2",
        "algorithm.outer.quantize=int4",
        "algorithm.outer.quantize_block=64",
        "algorithm.outer.error_feedback=true",
        "algorithm.outer.momentum=0.9",
    ],
    "partial": [
        "algorithm=fl_fsdp",
        "topology=local_4",
        "algorithm.every=2",
        "algorithm.federate=[model\\.layers\\..*]",
    ],
    "schedule": ["algorithm=fl_hsdp", "topology=local_4", "algorithm.every=[[0,2],[4,4]]"],
}
ELASTIC = ["algorithm=fl_fsdp", "topology=local_2", "algorithm.every=2", "algorithm.elastic=true"]

# what a run computes, not how long it took
KEEP = {
    "step",
    "split",
    "loss",
    "lr",
    "tokens",
    "aggregated",
    "eval_of",
    "group_perplexity",
    "participants",
    "committed",
    "fragments",
    "fragments_sent",
    "group",
}


def pinned(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k in KEEP or k.startswith(("bytes_", "collectives_"))} for r in rows]


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return pinned([json.loads(line) for line in lines])


def machine() -> dict:
    """What decides the kernels' summation order: torch, its CPU capability, and the CPU's vector
    extensions (2026-12-05: two machines both "AVX512" to torch summed apart at 1e-7; the newer
    has AMX and AVX512-FP16, the other's flags were not recorded)."""
    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(), "isa": vector_flags()}


def vector_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))


def check(name: str, got: list[dict]) -> None:
    stored = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {"machine": machine(), "runs": {}}
    if WRITE:
        stored["machine"] = machine()
        stored["runs"][name] = got
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
        return
    want = stored["runs"][name]
    if stored["machine"] == machine():
        assert got == want, first_difference(got, want)
    else:  # another torch or CPU kernel set: the same run, summed perhaps in another order
        assert [r.keys() for r in got] == [r.keys() for r in want]
        for g, w in zip(got, want):
            for k in g:
                assert close(g[k], w[k]), f"step {g['step']} {g.get('split')} {k}: {g[k]} != {w[k]}"


def close(a, b) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return math.isclose(a, b, rel_tol=1e-5)
    return a == b


def first_difference(got: list[dict], want: list[dict]) -> str:
    if len(got) != len(want):
        return f"{len(got)} rows, {len(want)} stored"
    for g, w in zip(got, want):
        if g != w:
            keys = sorted(k for k in g.keys() | w.keys() if g.get(k) != w.get(k))
            return f"step {g.get('step')} {g.get('split')}: " + ", ".join(
                f"{k} {g.get(k)!r} != {w.get(k)!r}" for k in keys
            )
    return "equal"


@pytest.mark.parametrize("name", CASES)
def test_records_are_those_stored(tmp_path, name):
    fl = not CASES[name][0].endswith(("=fsdp", "=hsdp"))
    cfg = compose_cfg(*CASES[name], *SHORT, *([BUCKETS] if fl else []))
    train_world(cfg, tmp_path)
    check(name, records(tmp_path))


def test_elastic_records_without_a_failure_are_those_stored(tmp_path):
    out = cli(
        *ELASTIC,
        *SHORT,
        BUCKETS,
        "wandb.mode=disabled",
        "trainer.progress=false",
        "trainer.eval_batches=1",
        f"hydra.run.dir={tmp_path}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    check("elastic", records(tmp_path) + [{"group": 1, **r} for r in records(tmp_path / "group_1")])
