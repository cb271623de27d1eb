"""What the communication meter costs: the same training run with `comm.measure=true` and
`comm.measure=false`, paired and interleaved (on, off, off, on, on, off, ...: the order alternates
per pair, so a drift in the machine's load favours neither side). Per pair, the ratio of the median
`time_step` (metrics.jsonl; the first --warmup steps left out), then the median of those ratios
against the goal (<= 1.01), and a check that every measured row carries nonzero bytes_shard.
Then the meter's own Python per step, timed in this process on a 1-rank gloo group (entering and
leaving the meter, and the recorder each collective passes through), times the collectives a step
issues: what the meter can cost, however loaded the machine is when the runs are timed.

    python experiments/bench_meter.py [--pairs 6] [--steps 30] [--warmup 2] [OVERRIDE ...]

OVERRIDEs (Hydra) replace the default run, `algorithm=fsdp topology=local_8`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT = ["algorithm=fsdp", "topology=local_8"]
GOAL = 1.01


def run(overrides: list[str], steps: int, measure: bool, run_dir: Path) -> tuple[list[dict], float]:
    """The training rows of one run and its whole-process wall time. cwd=ROOT: this checkout's fldp."""
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "fldp.train",
            *overrides,
            f"trainer.steps={steps}",
            f"comm.measure={str(measure).lower()}",
            "comm.emulate=false",
            "wandb.mode=disabled",
            "trainer.progress=false",
            "trainer.eval_batches=1",
            f"hydra.run.dir={run_dir}",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") is None], wall


def _best(fn, calls: int, repeats: int = 5) -> float:
    """Seconds per call, best of `repeats` loops (the least disturbed by other load)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def meter_overhead() -> tuple[float, float]:
    """Seconds the meter adds: (entering + leaving it, once per step; one collective's recorder)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fldp.comm import CommMeter
    from fldp.mesh import DIMS

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=DIMS)
        group, meter = mesh["shard"].get_group(), CommMeter(mesh)
        out, x = torch.empty(8), torch.empty(8)

        def bare(*args, **kwargs):
            return None

        recorded = meter._recorder("all_gather_single", bare)
        per_collective = _best(lambda: recorded(out, x, group=group, async_op=True), 20000) - _best(
            lambda: bare(out, x, group=group, async_op=True), 20000
        )

        def enter_exit():
            with meter:
                pass

        return _best(enter_exit, 5000), per_collective
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of each median")
    ap.add_argument("overrides", nargs="*", default=DEFAULT)
    args = ap.parse_args()
    print(
        f"python -m fldp.train {' '.join(args.overrides)} trainer.steps={args.steps}: "
        f"comm.measure=true (on) vs false (off), {args.pairs} interleaved pairs, "
        f"median time_step of steps > {args.warmup}"
    )
    ratios, missing, collectives, off_steps = [], [], [], []
    world = None
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            order = (True, False) if pair % 2 == 0 else (False, True)
            median, wall = {}, {}
            for measure in order:
                rows, wall[measure] = run(
                    args.overrides, args.steps, measure, Path(tmp) / f"{pair}-{'on' if measure else 'off'}"
                )
                median[measure] = statistics.median(r["time_step"] for r in rows[args.warmup :])
                if measure:
                    missing += [(pair, r["step"]) for r in rows if not r.get("bytes_shard")]
                    collectives += [sum(v for k, v in r.items() if k.startswith("collectives_")) for r in rows]
                    world = json.loads((Path(tmp) / f"{pair}-on" / "summary.json").read_text())["world_size"]
                else:
                    off_steps.append(median[False])
            ratios.append(median[True] / median[False])
            print(
                f"  pair {pair + 1} ({'on, off' if order[0] else 'off, on'}): median step "
                f"on {median[True] * 1e3:.1f} ms, off {median[False] * 1e3:.1f} ms, ratio {ratios[-1]:.4f}"
                f"   (process wall {wall[True]:.1f} s vs {wall[False]:.1f} s)"
            )
    ratio = statistics.median(ratios)
    print(
        f"median ratio on / off: {ratio:.4f} (pairs: min {min(ratios):.4f}, max {max(ratios):.4f})"
        f"   goal <= {GOAL}: {'MET' if ratio <= GOAL else 'NOT MET'}"
    )
    print(
        "bytes_shard nonzero on every measured row: "
        + ("yes" if not missing else f"NO, zero or absent at (pair, step) {missing[:10]}")
    )
    enter_exit, per_collective = meter_overhead()
    per_step = statistics.fmean(collectives)
    cost = enter_exit + per_step * per_collective
    # every rank pays it; with more ranks than cores they pay it one after another
    serial = max(1.0, world / (os.cpu_count() or 1))
    step = statistics.median(off_steps)
    print(
        f"meter's own cost per rank and step: enter + exit {enter_exit * 1e6:.1f} us + {per_step:.1f} "
        f"collectives x {per_collective * 1e6:.2f} us = {cost * 1e6:.0f} us; x {serial:g} ({world} ranks on "
        f"{os.cpu_count()} cores) = {cost * serial / step:.3%} of the median unmeasured step"
    )


if __name__ == "__main__":
    main()
