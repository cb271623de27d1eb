"""Streaming aggregation on emulated nodes (issue 22; a benchmark, not a timed test): what overlap
and fragments take off the critical path, against the cost model, side by side in one run.

Per seed and algorithm (FL+FSDP 4x1x2 and FL+HSDP 2x2x2 on netns_4x2: 4 nodes, each node's link
capped), five variants of the same run, interleaved so load on the machine hits them alike:
  plain     P = 1, tau = 0 (today's aggregation, the reference)
  overlap   P = 1, tau = 1 (the all-reduce in flight during one step)
  overlap3  P = 1, tau = 3 (during three: as long as the all-reduce takes here, by the model)
  fragments P = 2, tau = 0 (half the model per aggregation, twice as often)
  streaming P = 2, tau = 1
and, asked for with --variants: fragments4 (P = 4; needs model.num_hidden_layers >= 3), and what
crosses: bf16 (the change in bf16: algorithm.outer.reduce_dtype), int8, fp8, int4 and int4_ef
(algorithm.outer.quantize, blocks of 256; _ef: error feedback).
A = 8, 17 steps; measured over steps 2-16 (two whole periods: step 1 starts up, 17 is the last
step's forced aggregation):
- aggregation seconds on the critical path per period: the sum of `critical_aggregation` (the
  slowest rank's) / 2, and the model's (fldp.cost `exposed_aggregation`: each fragment's all-reduce
  on the link, less tau x the median compute of a step of this run, forward + backward + optimizer,
  plus FL+HSDP's broadcast of the merged weights to the replicas);
- step seconds per period (the sum of `time_step` / 2): what overlap buys, if anything;
- peak federation bytes per aggregation step (the byte meter, rank 0), and the model's;
- the final eval perplexity.
Ratios to `plain`, paired by seed: the geometric mean with its 95% t interval (analysis.stats).

    python experiments/bench_streaming.py [--seeds 5] [--out DIR] [--algorithms fl_fsdp,fl_hsdp]
                                          [--variants plain,overlap,...] [OVERRIDES]

(`plain` must be among the variants: the ratios are to it.)

Needs root and iproute2. Writes DIR/results.csv (one row per run) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_netns import compose_cfg, fork, write_results  # noqa: E402  (this script's folder is on sys.path)

from analysis.stats import TIE_HIGH, TIE_LOW, paired_ratio  # noqa: E402
from fldp.config import load  # noqa: E402
from fldp.cost import config_model, predict_for  # noqa: E402
from fldp.data import prepare  # noqa: E402
from fldp.validation import check_netns  # noqa: E402

EVERY, STEPS, WINDOW = 8, 17, range(2, 17)  # WINDOW: two whole periods
PERIODS = len(WINDOW) / EVERY
STREAM = "algorithm.streaming"
VARIANTS = {  # name -> its overrides; the first five are the default (the committed tables)
    "plain": [],
    "overlap": [f"{STREAM}.overlap=1"],
    "overlap3": [f"{STREAM}.overlap=3"],
    "fragments": [f"{STREAM}.fragments=2"],
    "streaming": [f"{STREAM}.fragments=2", f"{STREAM}.overlap=1"],
    "fragments4": [f"{STREAM}.fragments=4"],  # needs 4 FSDP units: model.num_hidden_layers >= 3
    # what crosses: the change in bf16 (reduce_dtype), or quantised (fldp/quantize.py, blocks of 256)
    "bf16": ["algorithm.outer.reduce_dtype=bf16"],
    "int8": ["algorithm.outer.quantize=int8"],
    "fp8": ["algorithm.outer.quantize=fp8"],
    "int4": ["algorithm.outer.quantize=int4"],
    "int4_ef": ["algorithm.outer.quantize=int4", "algorithm.outer.error_feedback=true"],
}
DEFAULT_VARIANTS = ["plain", "overlap", "overlap3", "fragments", "streaming"]
ALGORITHMS = {"fl_fsdp": "FL+FSDP", "fl_hsdp": "FL+HSDP"}
COMMON = [
    "topology=netns_4x2",
    f"trainer.steps={STEPS}",
    f"algorithm.every={EVERY}",
    "comm.measure=true",
    "wandb.mode=disabled",
    "trainer.progress=false",
    "trainer.eval_batches=null",
]


def _train(cfg, run_dir, blocks, device):
    from fldp.trainer import train

    train(cfg, run_dir, blocks, device)


def overrides(algorithm: str, variant: str, seed: int, extra=()) -> list[str]:
    return [f"algorithm={algorithm}", *COMMON, f"seed={seed}", *VARIANTS[variant], *extra]


def run(cfg, blocks, tmp: Path) -> dict:
    """One run through the launcher and trainer `python -m fldp.train` uses, forked from here."""
    run_dir = tmp / f"{cfg.algorithm.name}-{time.monotonic_ns()}"
    fork(_train, cfg, (cfg, str(run_dir), blocks))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["network"] == "netns", summary["network"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("split") is None and r["step"] in WINDOW]
    compute = statistics.median(
        r["critical_forward"] + r["critical_backward"] + r["critical_optimizer"] for r in steps if not r["aggregated"]
    )
    final = next(r for r in reversed(rows) if r.get("split") == "eval")
    return {
        "aggregation_s": sum(r["critical_aggregation"] for r in steps) / PERIODS,
        "step_s": sum(r["time_step"] for r in steps) / PERIODS,
        "compute_s": compute,
        "peak_bytes": max(r["bytes_federation"] for r in steps),
        "perplexity": final["perplexity"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", type=Path, help="write results.csv here (default: a temporary directory)")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"plain and any of {', '.join(VARIANTS)}")
    ap.add_argument(
        "overrides", nargs="*", help="Hydra overrides for every run, e.g. algorithm.fedavg.mode=all_replicas"
    )
    args = ap.parse_args()
    algorithms, variants = args.algorithms.split(","), args.variants.split(",")
    if "plain" not in variants or not set(variants) <= set(VARIANTS) or not set(algorithms) <= set(ALGORITHMS):
        ap.error(f"--variants: plain and any of {', '.join(VARIANTS)}; --algorithms: any of {', '.join(ALGORITHMS)}")
    start = time.monotonic()
    cfg0 = compose_cfg(*overrides(algorithms[0], "plain", 0, args.overrides))
    check_netns(load(cfg0), forks_locally=True)
    blocks = prepare(cfg0.dataset)
    import fldp.trainer  # noqa: F401  (once here, not in every forked worker)

    results = sweep(cfg0, blocks, algorithms, variants, args)
    frame = pd.DataFrame(results)
    if args.out:
        write_results(args.out, results)

    link = cfg0.topology.network[-1]
    print(
        f"\nnetns_4x2: 4 nodes x 2 ranks, link {link.gbit_s * 1e3:g} Mbit/s per node, model={cfg0.model.name}, "
        f"A={EVERY}, {STEPS} steps (measured over steps {WINDOW.start}-{WINDOW.stop - 1}), {args.seeds} seeds, "
        f"{time.monotonic() - start:.0f} s{'; ' + ' '.join(args.overrides) if args.overrides else ''}"
    )
    print_medians(frame, algorithms, variants)
    print_ratios(frame, algorithms, variants)


def sweep(cfg0, blocks, algorithms: list[str], variants: list[str], args) -> list[dict]:
    """Every seed x algorithm x variant run once, seed by seed, each beside the model's prediction."""
    _, units = config_model(load(cfg0))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for algorithm in algorithms:
                for variant in variants:
                    cfg = compose_cfg(*overrides(algorithm, variant, seed, args.overrides))
                    measured = run(cfg, blocks, Path(tmp))
                    pred = predict_for(load(cfg), units)
                    results.append(
                        {
                            "seed": seed,
                            "algorithm": algorithm,
                            "variant": variant,
                            **measured,
                            "predicted_aggregation_s": pred.exposed_aggregation(measured["compute_s"]),
                            "predicted_peak_bytes": pred.peak_aggregation_bytes,
                        }
                    )
                    print(f"seed {seed} {algorithm} {variant}: {measured}", flush=True)
    return results


def print_medians(frame: pd.DataFrame, algorithms: list[str], variants: list[str]) -> None:
    print(
        "\nper period A (medians over seeds): aggregation on the critical path, measured and the model's "
        "(collectives only); step time; peak federation bytes per aggregation step, measured and the model's; "
        "final eval perplexity"
    )
    print(
        f"{'':9s} {'variant':10s} {'agg s':>7s} {'model':>7s} {'step s':>7s} {'compute':>8s} "
        f"{'peak MB':>8s} {'model':>7s} {'ppl':>7s}"
    )
    for algorithm in algorithms:
        name = ALGORITHMS[algorithm]
        for variant in variants:
            v = frame[(frame.algorithm == algorithm) & (frame.variant == variant)]
            print(
                f"{name:9s} {variant:10s} {v.aggregation_s.median():7.3f} {v.predicted_aggregation_s.median():7.3f} "
                f"{v.step_s.median():7.3f} {v.compute_s.median():8.3f} {v.peak_bytes.median() / 1e6:8.3f} "
                f"{v.predicted_peak_bytes.median() / 1e6:7.3f} {v.perplexity.median():7.2f}"
            )


def print_ratios(frame: pd.DataFrame, algorithms: list[str], variants: list[str]) -> None:
    print(
        f"\nratios to plain, paired by seed: geometric mean [95% t interval]; ppl tie band {TIE_LOW:.3f}-{TIE_HIGH:.3f}"
    )
    bf16 = "bf16" in variants  # the quantised bytes against the change sent in bf16 too
    print(
        f"{'':9s} {'variant':10s} {'aggregation':>24s} {'step':>24s} {'peak bytes':>11s} "
        f"{'/ bf16' if bf16 else '':>7s} {'eval ppl':>24s} verdict"
    )
    for algorithm in algorithms:
        name = ALGORITHMS[algorithm]
        base = frame[(frame.algorithm == algorithm) & (frame.variant == "plain")].set_index("seed")
        for variant in [v for v in variants if v != "plain"]:
            v = frame[(frame.algorithm == algorithm) & (frame.variant == variant)].set_index("seed")
            agg, step, ppl = (paired_ratio(v[k], base[k]) for k in ("aggregation_s", "step_s", "perplexity"))
            peak = (v.peak_bytes / base.peak_bytes).median()
            halves = frame[(frame.algorithm == algorithm) & (frame.variant == "bf16")].set_index("seed")
            to_bf16 = f"{(v.peak_bytes / halves.peak_bytes).median():7.4f}" if bf16 else ""
            print(
                f"{name:9s} {variant:10s} {agg.text():>24s} {step.text():>24s} {peak:11.4f} {to_bf16:>7s} "
                f"{ppl.text():>24s} {ppl.verdict}"
            )


if __name__ == "__main__":
    main()
