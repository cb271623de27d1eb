"""fldp's DiLoCo beside torchft's, side by side in one run (issue 22; a benchmark, not a timed test).

The same layout and link: 4 federation groups of one rank each, one per emulated node (netns_4x2 with
one rank a node: each node's link capped at 50 Mbit/s); the same tiny_llama, initial weights, data
(group g reads rank g's batches), AdamW and schedule; DiLoCo's outer step (Nesterov SGD, lr 0.7,
momentum 0.9) every A = 8 steps, 17 steps. torchft's DiLoCo holds one rank per replica group, so
this is the layout both can run.
  fldp     algorithm=fl_fsdp, mesh 4x1x1, through the launcher and trainer `python -m fldp.train` uses
  torchft  `torchft.local_sgd.DiLoCo` over a Manager per group (its gloo process group) and a
           lighthouse on node 0, each group forked by fldp's elastic launcher on the same nodes;
           its all-reduces bucketed as fldp's (25 MB)
Run alternately per seed, so load on the machine hits both alike. Measured over steps 2-16 (two
whole periods; step 1 starts up, 17 is fldp's forced last aggregation): step seconds per period
(the sum of group 0's step times / 2), and the aggregation's seconds per period (each aggregation
step less the median step without one). The per-step losses of the two must agree (the same
computation): their largest relative difference is printed.

    python experiments/bench_diloco.py [--seeds 5] [--out DIR]

Needs root and iproute2. Writes DIR/results.csv (one row per run) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_netns import compose_cfg, fork, write_results  # noqa: E402  (this script's folder is on sys.path)

from analysis.stats import paired_ratio  # noqa: E402
from fldp import elastic, netns  # noqa: E402
from fldp.config import load  # noqa: E402
from fldp.cost import model_units, predict_for  # noqa: E402
from fldp.data import RankBatches, prepare  # noqa: E402
from fldp.mesh import mesh_shape  # noqa: E402
from fldp.model import DTYPES, build_model, llama_config  # noqa: E402
from fldp.validation import check_netns  # noqa: E402

EVERY, STEPS, WINDOW = 8, 17, range(2, 17)
PERIODS = len(WINDOW) / EVERY
GROUPS = 4
LAYOUT = [
    "algorithm=fl_fsdp",
    "topology=netns_4x2",
    "topology.procs_per_node=1",
    f"mesh.federation={GROUPS}",
    "mesh.shard=1",
    "topology.network=[{tier:node,ranks:1,gbit_s:2,latency_ms:2},"
    "{tier:inter-node,ranks:4,gbit_s:0.05,link:node,delay_ms:0}]",
    f"trainer.steps={STEPS}",
    f"algorithm.every={EVERY}",
    "algorithm.outer.lr=0.7",
    "algorithm.outer.momentum=0.9",
    "algorithm.outer.nesterov=true",
    "wandb.mode=disabled",
    "trainer.progress=false",
    "trainer.eval_batches=1",
]


def _fldp(cfg, run_dir, blocks, device):
    from fldp.trainer import train

    train(cfg, run_dir, blocks, device)


def _torchft(cfg, blocks, out, member, device):
    """One replica group of torchft's DiLoCo (one rank): fldp's group `member.group`'s model, data,
    optimiser and schedule; each step's loss and seconds into out/torchft_g{G}.json."""
    import socket
    from datetime import timedelta

    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from fldp.model import build_model, init_weights, llama_config
    from fldp.trainer import build_optimizer, build_scheduler

    model = build_model(llama_config(cfg.model, blocks.vocab_size))
    init_weights(model, torch.device("cpu"), cfg.seed)
    inner = build_optimizer(model, cfg.optimizer)
    scheduler = build_scheduler(inner, cfg.optimizer, STEPS)
    outer = [torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)]
    timeout = timedelta(seconds=cfg.cluster.timeout_s)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=GROUPS,
        use_async_quorum=False,
        rank=0,
        world_size=1,
        store_addr=os.environ["MASTER_ADDR"],
        store_port=int(os.environ["MASTER_PORT"]),
        lighthouse_addr=member.lighthouse,
        replica_id=f"group_{member.group}",
        timeout=timeout,
        hostname=socket.gethostname(),
    )  # the node's (its default is read when torchft is imported)
    batches = RankBatches(blocks.train, cfg.trainer.batch_size, member.group, GROUPS, cfg.seed).stream()
    losses, seconds = [], []
    # buckets of fldp's size (algorithm.fedavg.bucket_mb=25): a few all-reduces, not one per tensor
    with DiLoCo(manager, [model], inner, outer, sync_every=EVERY, use_bucketization=True, bucket_cap_mb=25):
        for _ in range(STEPS):
            start = time.perf_counter()
            x = next(batches)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            inner.step()  # DiLoCo's hook: the outer step every EVERY steps
            scheduler.step()
            inner.zero_grad()
            losses.append(loss.item())
            seconds.append(time.perf_counter() - start)
    manager.shutdown(wait=False)
    Path(out, f"torchft_g{member.group}.json").write_text(json.dumps({"loss": losses, "seconds": seconds}))


def per_period(seconds: list[float], aggregated: list[bool]) -> dict:
    """Over WINDOW (steps are 1-based): step seconds per period, and the aggregation steps' excess
    over the median step without one, per period."""
    window = [(s, a) for step, (s, a) in enumerate(zip(seconds, aggregated), 1) if step in WINDOW]
    plain = statistics.median(s for s, a in window if not a)
    return {
        "step_s": sum(s for s, _ in window) / PERIODS,
        "aggregation_s": sum(s - plain for s, a in window if a) / PERIODS,
    }


def run_fldp(cfg, blocks, tmp: Path) -> tuple[dict, list[float]]:
    run_dir = tmp / f"fldp-{time.monotonic_ns()}"
    fork(_fldp, cfg, (cfg, str(run_dir), blocks))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("split") is None]
    return per_period([r["time_step"] for r in steps], [r["aggregated"] for r in steps]), [r["loss"] for r in steps]


def run_torchft(cfg, blocks, tmp: Path) -> tuple[dict, list[float]]:
    out = tmp / f"torchft-{time.monotonic_ns()}"
    out.mkdir()
    elastic.run_local(
        _torchft, (cfg, blocks, str(out)), mesh_shape(cfg), cfg.cluster, str(out), network=netns.from_config(load(cfg))
    )
    groups = [json.loads((out / f"torchft_g{g}.json").read_text()) for g in range(GROUPS)]
    losses = [sum(g["loss"][i] for g in groups) / GROUPS for i in range(STEPS)]  # fldp's row: the ranks' mean
    aggregated = [step % EVERY == 0 for step in range(1, STEPS + 1)]
    return per_period(groups[0]["seconds"], aggregated), losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", type=Path, help="write results.csv here (default: a temporary directory)")
    args = ap.parse_args()
    start = time.monotonic()
    cfg0 = compose_cfg(*LAYOUT, "seed=0")
    check_netns(load(cfg0), forks_locally=True)
    blocks = prepare(cfg0.dataset)
    import torchft.local_sgd  # noqa: F401

    import fldp.trainer  # noqa: F401  (once here, not in every forked worker)

    units = model_units(
        build_model(llama_config(cfg0.model, blocks.vocab_size), "meta"), DTYPES[cfg0.trainer.precision]
    )
    model_s = predict_for(load(cfg0), units).exposed_aggregation(0.0)  # one aggregation's all-reduce on the link
    results, gaps = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            cfg = compose_cfg(*LAYOUT, f"seed={seed}")
            losses = {}
            for name, run in (("fldp", run_fldp), ("torchft", run_torchft)):
                measured, losses[name] = run(cfg, blocks, Path(tmp))
                results.append({"seed": seed, "system": name, **measured})
                print(f"seed {seed} {name}: {measured}", flush=True)
            gaps.append(max(abs(a - b) / abs(b) for a, b in zip(losses["fldp"], losses["torchft"])))
    frame = pd.DataFrame(results)
    if args.out:
        write_results(args.out, results)
    print(
        f"\nDiLoCo 4x1x1 on netns_4x2 with one rank a node (50 Mbit/s links), tiny_llama, A={EVERY}, {STEPS} steps "
        f"(measured over steps {WINDOW.start}-{WINDOW.stop - 1}), {args.seeds} seeds, {time.monotonic() - start:.0f} s"
    )
    print(f"per-step losses, fldp against torchft: largest relative difference {max(gaps):.2e}")
    print(f"the cost model's aggregation per period (a ring all-reduce of the fp32 model on the link): {model_s:.3f} s")
    print(f"\nper period A (medians over seeds)\n{'system':8s} {'step s':>7s} {'agg s':>7s}")
    for name in ("fldp", "torchft"):
        v = frame[frame.system == name]
        print(f"{name:8s} {v.step_s.median():7.3f} {v.aggregation_s.median():7.3f}")
    ours, theirs = (frame[frame.system == s].set_index("seed") for s in ("fldp", "torchft"))
    print("\nfldp / torchft, paired by seed: geometric mean [95% t interval]")
    for key in ("step_s", "aggregation_s"):
        print(f"{key:14s} {paired_ratio(ours[key], theirs[key]).text()}")


if __name__ == "__main__":
    main()
