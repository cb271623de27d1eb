"""Communication benchmark, printed from one run on this machine (not a timed test):

(a) FedAvg's aggregation time against one flat all-reduce of the same bytes on the same
    federation group (goal: <= 1.15x): what bucketing costs beyond the collective itself.
(b) With emulated Leonardo-like tiers (comm.emulate=true), the measured step-time ratios
    FSDP / FL+FSDP and HSDP / FL+FSDP on local_8, beside the cost model's prediction for the same
    meshes (goal: within 15%). Prediction = the same algorithm's measured step time without
    emulation (compute) + the byte-exact model's communication time on the emulated tiers.

    python experiments/bench_comm.py [--scale 5e-5] [--steps 10] [--repeats 30] [--only-fedavg]
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

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fldp  # noqa: E402,F401
from fldp.aggregation import FedAvg, FedAvgConfig  # noqa: E402
from fldp.cost import model_units, predict, tier_bandwidth  # noqa: E402
from fldp.launch import run_local  # noqa: E402
from fldp.mesh import MeshShape, build_mesh, group_mesh, mesh_shape  # noqa: E402
from fldp.model import build_model, llama_config, parallelize  # noqa: E402


def compose_cfg(*overrides):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


# ---------------------------------------------------------------- (a) FedAvg vs flat all-reduce
def _fedavg_worker(repeats, bucket_mb, out, device):
    shape = MeshShape(2, 1, 2)
    mesh = build_mesh(shape, "cpu")
    cfg = compose_cfg("model.hidden_size=256", "model.intermediate_size=704", "model.num_hidden_layers=4")
    torch.manual_seed(0)
    model = parallelize(build_model(llama_config(cfg.model, 4096)), group_mesh(mesh, shape), torch.float32)
    fedavg = FedAvg(model, mesh, shape, FedAvgConfig(every=1, bucket_mb=bucket_mb), last_step=1)
    shards = [t for bucket in fedavg.buckets for t in bucket.shards]
    # the reference: the same bytes, dtype and federation group, in one persistent flat tensor
    flat = torch.randn(sum(t.numel() for t in shards), dtype=shards[0].dtype)
    assert {t.dtype for t in shards} == {flat.dtype}
    group = mesh["federation"].get_group()

    def flat_allreduce():
        dist.all_reduce(flat, group=group)
        flat.div_(shape.federation)

    # with several buckets, also the same bytes in the buckets' pieces, all in flight as FedAvg has
    # them: what the number of collectives costs, apart from what FedAvg does around them
    pieces = torch.split(flat, [bucket.numel for bucket in fedavg.buckets])

    def pieces_allreduce():
        works = [dist.all_reduce(piece, group=group, async_op=True) for piece in pieces]
        for work, piece in zip(works, pieces):
            work.wait()
            piece.div_(shape.federation)

    runs = [("fedavg", fedavg), ("flat", flat_allreduce)] + ([("pieces", pieces_allreduce)] if len(pieces) > 1 else [])
    times = {name: [] for name, _ in runs}
    for i in range(repeats + 2):  # the first two rounds are warm-up
        for name, fn in runs[i % len(runs) :] + runs[: i % len(runs)]:  # rotate which goes first
            dist.barrier()
            start = time.perf_counter()
            fn()
            took = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if i >= 2:
                times[name].append(took.item())
    if dist.get_rank() == 0:
        Path(out).write_text(
            json.dumps(
                {
                    "bytes": flat.numel() * flat.element_size(),
                    "buckets": len(fedavg.buckets),
                    "copied": sum(len(b.copied) for b in fedavg.buckets),
                    "shards": len(shards),
                    **times,
                }
            )
        )


def bench_fedavg(repeats: int, bucket_mb: float) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fedavg.json"
        run_local(
            _fedavg_worker,
            (repeats, bucket_mb, str(out)),
            4,
            "cpu",
            OmegaConf.create(
                {"master_addr": "127.0.0.1", "master_port": None, "timeout_s": 300, "threads_per_worker": 1}
            ),
        )
        r = json.loads(out.read_text())
    fed, flat = statistics.median(r["fedavg"]), statistics.median(r["flat"])
    pairs = sorted(a / b for a, b in zip(r["fedavg"], r["flat"]))
    q1, _, q3 = statistics.quantiles(pairs, n=4)
    print(
        f"(a) FedAvg of {r['bytes'] / 2**20:.1f} MiB fp32 per rank in {r['buckets']} bucket(s) "
        f"({r['shards'] - r['copied']} of {r['shards']} shards in place), F=2 groups of 2 ranks, "
        f"{repeats} interleaved repeats (order rotating, 2 warm-up rounds)"
    )
    print(f"    FedAvg median {fed * 1e3:.1f} ms, flat all-reduce of the same bytes median {flat * 1e3:.1f} ms")
    print(
        f"    ratio FedAvg / flat: {fed / flat:.3f} (medians); pairwise median {statistics.median(pairs):.3f}, "
        f"quartiles {q1:.3f}-{q3:.3f}, min {pairs[0]:.3f}, max {pairs[-1]:.3f}"
        f"   goal <= 1.15: {'MET' if fed / flat <= 1.15 else 'NOT MET'}"
    )
    if "pieces" in r:
        pieces = statistics.median(r["pieces"])
        print(
            f"    the same bytes in {r['buckets']} all-reduces (the buckets' sizes, all in flight): median "
            f"{pieces * 1e3:.1f} ms, {pieces / flat:.3f}x the flat one; FedAvg / these {fed / pieces:.3f}"
        )
    return fed / flat


# ---------------------------------------------------------------- (b) emulated tiers
def _run(algorithm: str, steps: int, emulate: bool, scale: float, tmp: Path) -> float:
    """Mean step time of one run (step 1, with its one-off start-up costs, left out)."""
    run_dir = tmp / f"{algorithm}-{'emu' if emulate else 'plain'}"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "fldp.train",
            f"algorithm={algorithm}",
            "topology=local_8",
            f"trainer.steps={steps}",
            "algorithm.every=8",
            f"comm.emulate={emulate}",
            f"comm.scale={scale}",
            "wandb.mode=disabled",
            "trainer.progress=false",
            "trainer.eval_batches=1",
            f"hydra.run.dir={run_dir}",
        ],
        check=True,
        cwd=ROOT,
        capture_output=True,
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.fmean(r["time_step"] for r in rows if r.get("split") is None and r["step"] > 1)


def bench_tiers(steps: int, scale: float) -> None:
    algorithms = ("fsdp", "hsdp", "fl_fsdp")
    measured, predicted = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in algorithms:
            cfg = compose_cfg(f"algorithm={algorithm}", "algorithm.every=8", f"comm.scale={scale}")
            shape = mesh_shape(cfg)
            units = model_units(build_model(llama_config(cfg.model, 4096), "meta"), torch.float32)
            bandwidth = tier_bandwidth(cfg.topology.network, shape, scale)
            comm = predict(units, shape, bandwidth, cfg.algorithm.every if cfg.algorithm.aggregation else None)
            compute = _run(algorithm, steps, False, scale, Path(tmp))
            measured[algorithm] = _run(algorithm, steps, True, scale, Path(tmp))
            predicted[algorithm] = compute + sum(comm.exact.values())
            print(
                f"    {algorithm:8s} mesh {shape}: step {measured[algorithm]:.3f} s measured, "
                f"{predicted[algorithm]:.3f} s predicted ({compute:.3f} s compute + "
                f"{sum(comm.exact.values()):.3f} s modelled communication)"
            )
    for num in ("fsdp", "hsdp"):
        m, p = measured[num] / measured["fl_fsdp"], predicted[num] / predicted["fl_fsdp"]
        err = abs(m / p - 1)
        print(
            f"    {num.upper()} / FL+FSDP step time: measured {m:.2f}x, predicted {p:.2f}x, off by "
            f"{err:.1%}   goal within 15%: {'MET' if err <= 0.15 else 'NOT MET'}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30, help="interleaved repeats of (a)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="FedAvg bucket size (algorithm.fedavg.bucket_mb)")
    ap.add_argument("--only-fedavg", action="store_true", help="run (a) only")
    # small enough that communication dominates compute, as for FSDP at 512 GPUs in the paper
    ap.add_argument("--scale", type=float, default=5e-5, help="emulated bandwidth = Leonardo's x scale")
    args = ap.parse_args()
    bench_fedavg(args.repeats, args.bucket_mb)
    if args.only_fedavg:
        return
    print(
        f"(b) local_8 with emulated Leonardo-like tiers (node of 4 ranks: 800 Gbit/s, across nodes: "
        f"200 Gbit/s, x {args.scale:g}), {args.steps} steps, A=8"
    )
    bench_tiers(args.steps, args.scale)


if __name__ == "__main__":
    main()
