"""The simulator's training FLOP/s at the paper's shape beside this machine's fp32 matmul peak, side
by side in one process (issue 49, item 1; a benchmark, not a timed test).

For each model of the ladder and each algorithm (default: fsdp, one group of 1,024 sequences, and
fl_fsdp, 128 groups of 8), first the peak: the fastest of `repeats` timings of an N x N fp32
torch.matmul (2 N^3 FLOPs); then the simulated run (+experiment=paper_shape, `steps` steps) in this
process. Its FLOP/s: a step's training FLOPs, 3 x fldp.steptime.flops_per_token (2 per weight used
in a matmul, the lm_head included and the input embedding not, plus causal attention's two
products) x the step's tokens, over the median `time_step` of its steps after the first. Printed
and written (OUT/results.csv) per row with the ratio to the peak measured just before it, and the
model's parameters: all, and without the input embedding and the lm_head (Kaplan et al.'s N).

    python experiments/bench_flops.py [--models tiny_llama,ladder_1,ladder_2,ladder_3,ladder_4]
        [--algorithms fsdp,fl_fsdp] [--steps 4] [--matmul 2048] [--precision fp32]
        [--against KEY=VALUE ...] [--skip MODEL:ALGORITHM ...] [--out experiments/flops]

--against KEY=VALUE (repeatable) runs each row first with that override, then as the simulator runs
by default, and prints how much faster a step the default is, side by side: e.g.
cluster.keep_freed_memory=false (glibc's defaults), cluster.stacked_attention=false (transformers'
sdpa, group by group). --skip leaves a pair out (ladder_4's FL+FSDP: 128 stacked copies of 15.7 M
parameters with their gradients and AdamW's two moments, ~32 GB, past this VM's 24 GiB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from bench_netns import compose_cfg, write_results  # noqa: E402

from fldp.config import load  # noqa: E402
from fldp.cost import config_model  # noqa: E402
from fldp.model import parameter_counts  # noqa: E402
from fldp.provenance import source_commit  # noqa: E402
from fldp.steptime import flops_per_token  # noqa: E402

QUIET = ["wandb.mode=disabled", "trainer.progress=false", "trainer.eval_batches=1", "dataset.eval_blocks=1024"]


def matmul_peak(n: int, repeats: int = 5) -> float:
    """FLOP/s of the fastest of `repeats` fp32 n x n matmuls (after one to warm up)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def parameters(cfg) -> dict[str, int]:
    """The model's parameters (fldp.model.parameter_counts)."""
    return parameter_counts(config_model(load(cfg))[0])


def simulated(cfg, run_dir: Path) -> list[dict]:
    """The run, simulated in this process: its training rows."""
    from fldp.train import run

    run(cfg, str(run_dir))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") is None]


def row(model: str, algorithm: str, args, tmp: Path, against: str = "") -> dict:
    """One (model, algorithm): the peak, then the simulated run's FLOP/s and its ratio to it;
    `against`: an override it runs with (else the simulator's defaults)."""
    cfg = compose_cfg(
        "+experiment=paper_shape",
        f"model={model}",
        f"algorithm={algorithm}",
        *QUIET,
        f"trainer.steps={args.steps}",
        f"trainer.precision={args.precision}",
        *([against] if against else []),
    )
    counts = parameters(cfg)
    m, seq = cfg.model, cfg.dataset.block_size
    step_flops = 3 * flops_per_token(
        counts["params"], counts["params"] - counts["params_matmul"], m.num_hidden_layers, m.hidden_size, seq
    )
    peak = matmul_peak(args.matmul)
    steps = simulated(cfg, tmp / f"{model}-{algorithm}-{len(against)}")
    tokens = steps[0]["tokens"]  # the first step's: tokens per step
    step_s = statistics.median(r["time_step"] for r in steps[1:])
    rate = step_flops * tokens / step_s
    found = {
        "model": model,
        "algorithm": algorithm,
        "precision": args.precision,
        "override": against,
        **counts,
        "tokens_per_step": tokens,
        "step_s": round(step_s, 4),
        "flop_s": round(rate),
        "peak_flop_s": round(peak),
        "ratio": round(rate / peak, 4),
    }
    print(
        f"{model} ({counts['params'] / 1e6:.2f} M parameters, N = {counts['params_non_embedding'] / 1e6:.2f} M) "
        f"{algorithm}{f' ({against})' if against else ''}: {step_s:.3f} s a step, {rate / 1e9:.1f} GFLOP/s against a matmul peak of "
        f"{peak / 1e9:.1f}: {rate / peak:.0%}",
        flush=True,
    )
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny_llama,ladder_1,ladder_2,ladder_3,ladder_4")
    ap.add_argument("--algorithms", default="fsdp,fl_fsdp")
    ap.add_argument("--steps", type=int, default=4, help="steps per run; the first is left out")
    ap.add_argument("--matmul", type=int, default=2048, help="N of the N x N matmul that measures the peak")
    # fp32: the precision of the studies the ladder extends; the paper's bf16 (leonardo_512's default)
    # has no fast CPU kernel without AVX-512 BF16 / AMX (this VM: a bf16 step several times an fp32 one)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="each row first with this override, then with the defaults, the speed-up printed (repeatable)",
    )
    ap.add_argument("--skip", action="append", default=[], metavar="MODEL:ALGORITHM", help="a pair not run")
    ap.add_argument("--out", default=str(ROOT / "experiments" / "flops"))
    args = ap.parse_args()
    start, rows = time.monotonic(), []
    print(f"commit {source_commit()}, torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for algorithm in args.algorithms.split(","):
                if f"{model}:{algorithm}" in args.skip:
                    continue
                baselines = [row(model, algorithm, args, Path(tmp), against) for against in args.against]
                rows += [*baselines, row(model, algorithm, args, Path(tmp))]
                for b in baselines:
                    print(
                        f"  the defaults against {b['override']}: {b['step_s'] / rows[-1]['step_s']:.2f}x faster a step"
                    )
                write_results(Path(args.out), rows)  # each row as it lands: a larger model may not fit
    print(f"{len(rows)} rows in {Path(args.out) / 'results.csv'}, {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
