"""What one failure costs with elastic federation, and with kill-requeue-resume (issue 20).

Per seed, three runs of FL+FSDP 4x1x2 on local_8 (A = 8, 32 steps), side by side:
1. clean: elastic, no failure (an elastic run without failures equals the static one bit for bit:
   tests/test_elastic.py);
2. elastic: every rank of group 2 SIGKILLed after step 13 (FLDP_FAULT); the group restarts, heals
   from live peers at a later aggregation and trains on;
3. static: checkpoint_every=8 and the same kill, which ends the run; then the run is resumed from
   its step-8 checkpoint (trainer.resume=auto), as a requeued job would be, at once.

Work lost per failure, in rank-seconds (steps whose results were discarded, and ranks kept idle):
- static: all W = 8 ranks x (the steps 9..13 the resume redoes, their time_step in the killed run's
  rows; plus the restart, from the kill to the start of the resumed run's step 9). SLURM's requeue
  delay (about 2 minutes on the test cluster) is not counted: this favours the static side;
- elastic: group 2's 2 ranks x (its steps since its last committed aggregation, and the time from
  the kill to its heal: the steps it misses), plus each surviving group's ranks x its extra
  aggregation time from the failure to the heal (waiting for the dead group to be declared dead, and
  for the restarted one), over its median aggregation time in the clean run.
The kill's moment is what the killed ranks print (fldp/faults.py), the heal's the heal row's
`healed_at`, the resumed step 9's the moment its row appears (polled every 10 ms) less its time_step.

Also per seed: the eval perplexity of the elastic run with the failure over the clean run's; the
geometric mean over seeds with its 95% t interval. (The static run's resume is exact: its final
model equals the clean static run's, tests/test_reliability.py.)

    python experiments/bench_elastic.py [--seeds 5] [--out DIR] [--chart PATH.png]

Writes DIR/results.csv (one row per seed) and prints the table and the ratios. For the failure-time
chart (analysis/elastic_timeline.py; --chart draws seed 0's) each seed keeps what the records lack:
DIR/seed_N/timeline.json (the unix moments of each launch, each kill, the resumed run's first step)
and static/killed_run_metrics.jsonl (the killed static run's rows, which the resume truncates).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's analysis/
from bench_netns import write_results  # noqa: E402  (this script's folder is on sys.path)

from analysis.elastic_timeline import KILLED_ROWS, MOMENTS, save_chart  # noqa: E402

COMMON = [
    "algorithm=fl_fsdp",
    "topology=local_8",
    "mesh.federation=4",
    "mesh.shard=2",
    "algorithm.every=8",
    "trainer.steps=32",
    "wandb.mode=disabled",
    "trainer.progress=false",
    "trainer.eval_batches=null",
]
GROUP, KILL_STEP, CHECKPOINT_EVERY, WORLD, GROUP_SIZE = 2, 13, 8, 8, 2
FAULT = f"group={GROUP},step={KILL_STEP}"
GOAL = 5.0


def train(
    run_dir: Path, *overrides: str, fault: bool = False, check: bool = True
) -> tuple[subprocess.CompletedProcess, float]:
    """One `python -m fldp.train` (cwd=ROOT: this checkout's fldp) and the unix time it started."""
    env = {k: v for k, v in os.environ.items() if k != "FLDP_FAULT"}
    if fault:
        env["FLDP_FAULT"] = FAULT
    began = time.time()
    out = subprocess.run(
        [sys.executable, "-m", "fldp.train", *COMMON, *overrides, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if check and out.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed:\n{out.stderr[-3000:]}")
    return out, began


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def killed_at(stderr: str) -> float:
    """The moment the first rank of the failing group died (fldp/faults.py prints it)."""
    moments = [float(m) for m in re.findall(r"FLDP_FAULT kills group \d+ at \w+ \S+ \(unix time ([0-9.]+)\)", stderr)]
    if not moments:
        raise SystemExit(f"no FLDP_FAULT kill in the run's output:\n{stderr[-3000:]}")
    return min(moments)


def group_dir(run_dir: Path, group: int) -> Path:
    return run_dir if group == 0 else run_dir / f"group_{group}"


def elastic_loss(clean: Path, failed: Path, stderr: str) -> dict:
    kill = killed_at(stderr)
    mine = rows(group_dir(failed, GROUP))
    heal = next(r for r in mine if r.get("split") == "heal")
    last_commit = max(r["step"] for r in mine if r.get("committed") and r["step"] <= KILL_STEP)
    discarded = sum(r["time_step"] for r in mine if "split" not in r and last_commit < r["step"] <= KILL_STEP)
    idle = heal["healed_at"] - kill
    waits = 0.0
    for g in range(4):
        if g == GROUP:
            continue
        usual = statistics.median(r["time_aggregation"] for r in rows(group_dir(clean, g)) if r.get("aggregated"))
        waits += GROUP_SIZE * sum(
            max(0.0, r["time_aggregation"] - usual)
            for r in rows(group_dir(failed, g))
            if r.get("aggregated") and KILL_STEP < r["step"] <= heal["step"]
        )
    return {
        "elastic_lost": GROUP_SIZE * (discarded + idle) + waits,
        "elastic_discarded_s": discarded,
        "elastic_idle_s": idle,
        "elastic_survivor_wait": waits,
        "heal_step": heal["step"],
        "time_heal": heal["time_heal"],
    }


def static_loss(run_dir: Path, seed: int, moments: dict) -> dict:
    """The kill, then the resume, its step 9 timed as its row appears; `moments` receives the unix
    times the chart needs."""
    killed, began = train(
        run_dir, f"seed={seed}", f"trainer.checkpoint_every={CHECKPOINT_EVERY}", fault=True, check=False
    )
    if killed.returncode == 0:
        raise SystemExit("the static run was not killed")
    kill = killed_at(killed.stderr)
    (run_dir / KILLED_ROWS).write_text((run_dir / "metrics.jsonl").read_text())
    redo = [r for r in rows(run_dir) if "split" not in r and CHECKPOINT_EVERY < r["step"] <= KILL_STEP]
    discarded = sum(r["time_step"] for r in redo)
    seen: dict = {}

    def watch():  # the moment the resumed run's first step is recorded (not the killed run's row)
        while "at" not in seen:
            try:
                with_row = [r for r in rows(run_dir) if "split" not in r and r["step"] == CHECKPOINT_EVERY + 1]
            except (OSError, ValueError):  # a row being appended
                with_row = []
            if with_row and with_row[0]["time_step"] != redo[0]["time_step"]:
                seen.update(at=time.time(), step_s=with_row[0]["time_step"])
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    _, relaunched = train(
        run_dir, f"seed={seed}", f"trainer.checkpoint_every={CHECKPOINT_EVERY}", "trainer.resume=auto"
    )
    seen.setdefault("at", None)
    watcher.join(timeout=1)
    if seen.get("at") is None:
        raise SystemExit("the resumed run's step 9 was not seen")
    moments.update(
        started=began, killed=kill, relaunched=relaunched, resumed_from=CHECKPOINT_EVERY, first_step_seen=seen["at"]
    )
    restart = seen["at"] - seen["step_s"] - kill
    return {"static_lost": WORLD * (discarded + restart), "static_discarded_s": discarded, "static_restart_s": restart}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument(
        "--out", type=Path, default=None, help="where the runs and results.csv go (default: a temporary dir)"
    )
    ap.add_argument("--chart", type=Path, default=None, help="draw seed 0's failure-time chart to this PNG")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_elastic_"))
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in range(args.seeds):
        base = out / f"seed_{seed}"
        clean, _ = train(base / "clean", f"seed={seed}", "algorithm.elastic=true")
        failed, began = train(base / "elastic", f"seed={seed}", "algorithm.elastic=true", fault=True)
        moments = {"elastic": {"started": began, "killed": killed_at(failed.stderr)}, "static": {}}
        row = {
            "seed": seed,
            **elastic_loss(base / "clean", base / "elastic", failed.stderr),
            **static_loss(base / "static", seed, moments["static"]),
        }
        (base / MOMENTS).write_text(json.dumps(moments, indent=1) + "\n")
        ppl = [json.loads((base / d / "summary.json").read_text())["eval_perplexity"] for d in ("clean", "elastic")]
        row.update(clean_ppl=ppl[0], elastic_ppl=ppl[1], ratio_lost=row["static_lost"] / row["elastic_lost"])
        results.append(row)
        print(
            f"seed {seed}: lost rank-s static {row['static_lost']:.1f} (redo {row['static_discarded_s']:.2f} s, "
            f"restart {row['static_restart_s']:.2f} s) / elastic {row['elastic_lost']:.1f} (discarded "
            f"{row['elastic_discarded_s']:.2f} s, idle {row['elastic_idle_s']:.2f} s, survivors' wait "
            f"{row['elastic_survivor_wait']:.1f} rank-s; healed at step {row['heal_step']}) = "
            f"{row['ratio_lost']:.1f}x; eval ppl {ppl[1]:.2f} with the failure, {ppl[0]:.2f} without",
            flush=True,
        )
    write_results(out, results)
    for name, values in (
        ("work lost, static / elastic", [r["ratio_lost"] for r in results]),
        ("eval perplexity, one failure / none", [r["elastic_ppl"] / r["clean_ppl"] for r in results]),
    ):
        logs = [math.log(v) for v in values]
        mean = statistics.mean(logs)
        half = (
            (stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs)))
            if len(logs) > 1
            else math.inf
        )
        print(
            f"{name}: geometric mean {math.exp(mean):.3f} [95% t interval {math.exp(mean - half):.3f}, "
            f"{math.exp(mean + half):.3f}] over {len(logs)} seeds (min {min(values):.3f}, max {max(values):.3f})"
        )
    print(f"goal: work lost static / elastic >= {GOAL}; records in {out}")
    if args.chart:
        print(f"failure-time chart of seed 0: {save_chart(out, 0, args.chart)}")


if __name__ == "__main__":
    main()
