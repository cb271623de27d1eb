"""The simulator's speed beside the distributed trainer's: the same run (same model, mesh, data,
steps) with `cluster=local` (8 forked workers over gloo) and `cluster=simulate` (one process),
paired and interleaved (the order alternates per pair, so a drift in the machine's load favours
neither side). Per run, training tokens per second (summary.json: tokens / train_time_s) and the
whole command's wall time; per pair, the simulator's ratio; then the median ratio against the goal
(>= 3x). With --paper-shape, the time of one simulated run at the paper's shape
(+experiment=paper_shape, 64 steps of 1,024 sequences).

    python experiments/bench_simulate.py [--pairs 3] [--steps 24] [--paper-shape ALGORITHM] [OVERRIDE ...]

OVERRIDEs (Hydra) replace the default run, `algorithm=fl_hsdp topology=local_8`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ["algorithm=fl_hsdp", "topology=local_8"]
GOAL = 3.0


def run(overrides: list[str], run_dir: Path) -> tuple[float, float, dict]:
    """(training tokens per second, whole-command wall seconds, summary) of one run."""
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "fldp.train",
            *overrides,
            "wandb.mode=disabled",
            "trainer.progress=false",
            f"hydra.run.dir={run_dir}",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    wall = time.perf_counter() - start
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary["tokens"] / summary["train_time_s"], wall, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--paper-shape", metavar="ALGORITHM", help="also time one paper-shaped simulated run")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    base = [*DEFAULT, *args.overrides, f"trainer.steps={args.steps}"]
    kinds = {"trainer": ["cluster=local"], "simulator": ["cluster=simulate"]}
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        print(f"run: {' '.join(base)}")
        print(
            f"{'pair':>4}  {'trainer tok/s':>13}  {'simulator tok/s':>15}  {'ratio':>6}  "
            f"{'trainer wall s':>14}  {'simulator wall s':>16}"
        )
        for pair in range(args.pairs):
            order = list(kinds) if pair % 2 == 0 else list(reversed(kinds))
            got = {k: run([*base, *kinds[k]], Path(tmp) / f"{k}_{pair}") for k in order}
            if got["trainer"][2]["eval_loss"] != got["simulator"][2]["eval_loss"]:
                gap = abs(got["trainer"][2]["eval_loss"] - got["simulator"][2]["eval_loss"])
                print(f"      (eval loss differs by {gap:.1e}: the collectives' summation order)")
            ratios.append(got["simulator"][0] / got["trainer"][0])
            print(
                f"{pair:>4}  {got['trainer'][0]:>13.0f}  {got['simulator'][0]:>15.0f}  {ratios[-1]:>5.2f}x  "
                f"{got['trainer'][1]:>14.1f}  {got['simulator'][1]:>16.1f}"
            )
        median = statistics.median(ratios)
        print(
            f"simulator / trainer tokens per second: median {median:.2f}x over {args.pairs} pairs "
            f"(min {min(ratios):.2f}, max {max(ratios):.2f}); goal >= {GOAL:g}x: {'met' if median >= GOAL else 'NOT met'}"
        )
        if args.paper_shape:
            tok_s, wall, summary = run(
                ["+experiment=paper_shape", f"algorithm={args.paper_shape}", *args.overrides], Path(tmp) / "paper_shape"
            )
            print(
                f"paper shape, {args.paper_shape} (mesh {summary['federation']}x{summary['replicate']}x"
                f"{summary['shard']}, {summary['steps']} steps, {summary['tokens']:,} tokens): training "
                f"{summary['train_time_s']:.0f} s ({tok_s:.0f} tok/s), whole command {wall:.0f} s"
            )


if __name__ == "__main__":
    main()
