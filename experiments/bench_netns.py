"""The cost model against a real capped network (not a timed test): the four algorithms on a netns
topology (emulated nodes, fldp/netns.py) and on plain loopback with the same meshes, paired and
interleaved, then per algorithm

    measured communication per step = step time on netns - step time on loopback
    predicted                       = fldp.cost.link_extra: the collectives on the capped link at its
                                      rate, less what they cost on loopback (the topology's node tier)
    bytes per step on the link      = node 0's link counter (/proc/net/dev in its namespace), against
                                      the model's (gloo's collectives, every flow crossing the link)

and the step-time ratios FSDP / FL+FSDP, HSDP / FL+FSDP, FL+HSDP / FL+FSDP, measured against
predicted (= loopback step + predicted communication; goal: within 15%). A step's time is amortised
as the cost model does, over the run: median of the steps without aggregation + (median of those
with it - that) x the share of the run's steps that aggregate, step 1 (start-up) left out of the
medians; then the median over repeats, since this machine's 2 cores are shared. Runs go through
fldp.launch.run_local and the trainer in this process (as `python -m fldp.train` does after
validation), so a run costs seconds of start-up, not tens. Needs root and iproute2.

    python experiments/bench_netns.py [--topology netns_2x4] [--steps 16] [--repeats 5] [--json OUT] [OVERRIDES]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fldp  # noqa: E402,F401
from fldp import netns  # noqa: E402
from fldp.config import load  # noqa: E402
from fldp.cost import config_model, link_extra, predict_for  # noqa: E402
from fldp.data import prepare  # noqa: E402
from fldp.launch import run_local  # noqa: E402
from fldp.mesh import mesh_shape  # noqa: E402
from fldp.records import PHASES  # noqa: E402
from fldp.validation import check_netns  # noqa: E402

NAMES = {"fsdp": "FSDP", "hsdp": "HSDP", "fl_fsdp": "FL+FSDP", "fl_hsdp": "FL+HSDP"}


def write_results(out: Path, rows: list[dict]) -> None:
    """out/results.csv, one row per run: the per-run numbers a benchmark's table comes from."""
    import csv

    out.mkdir(parents=True, exist_ok=True)
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def compose_cfg(*overrides):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def amortised(rows: list[dict], key: str) -> float:
    """Median of the steps without aggregation + (median of those with it - that) x the share of the
    run's steps that aggregate (the last always does: fldp.cost amortises alike); step 1 (start-up)
    left out of the medians."""
    share = sum(bool(r["aggregated"]) for r in rows) / len(rows)
    rows = [r for r in rows if r["step"] > 1]
    plain = statistics.median(r[key] for r in rows if not r["aggregated"])
    agg = [r[key] for r in rows if r["aggregated"]]
    return plain + (statistics.median(agg) - plain) * share if agg else plain


def _link_tx() -> int:
    """Bytes this namespace has sent on its node's link (/proc/net/dev is per namespace)."""
    for line in open("/proc/net/dev"):
        name, _, fields = line.partition(":")
        if name.strip() == netns.IFACE:
            return int(fields.split()[8])
    return 0


class LinkMeter:
    """on_step: rank 0 (node 0) records the bytes its node sent over the link during each step."""

    def __init__(self, path: Path):
        self.path, self.rows, self.last = path, [], None

    def __call__(self, step, state, aggregated):  # on_step: the training state is not read
        if dist.get_rank() != 0:
            return
        tx = _link_tx()
        if self.last is not None:
            self.rows.append({"step": step, "aggregated": aggregated, "bytes": tx - self.last})
            self.path.write_text(json.dumps(self.rows))
        self.last = tx


def fork(fn, cfg, args: tuple) -> None:
    """fn(*args, device) on the config's ranks, forked here as fldp.train forks them (on its
    emulated nodes, if the topology has them)."""
    run_local(fn, args, mesh_shape(cfg).world, "cpu", cfg.cluster, network=netns.from_config(load(cfg)))


def _train(cfg, run_dir, blocks, meter, device):
    from fldp.trainer import train

    train(cfg, run_dir, blocks, device, on_step=meter)


def run(cfg, blocks, tmp: Path) -> dict:
    """One run in this process (fork, no start-up of Python, torch and Hydra: seconds, not tens of
    seconds, so more repeats fit), through the same launcher and trainer as `python -m fldp.train`."""
    run_dir = tmp / f"{cfg.algorithm.name}-{time.monotonic_ns()}"
    shape = mesh_shape(cfg)
    network = netns.from_config(load(cfg))
    meter = LinkMeter(run_dir.with_suffix(".link.json")) if network else None
    run_local(_train, (cfg, str(run_dir), blocks, meter), shape.world, "cpu", cfg.cluster, network=network)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["network"] == ("netns" if network else "loopback"), summary["network"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("split") is None]
    out = {"step_s": amortised(steps, "time_step")}
    # the slowest rank's phases (they add up to its step), amortised alike: the step-time model's terms
    out["phases_s"] = {p: amortised(steps, f"critical_{p}") for p in PHASES}
    if meter:
        out["link_bytes"] = amortised(json.loads(meter.path.read_text()), "bytes")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default="netns_2x4")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--every", type=int, default=8, help="A, the aggregation period")
    ap.add_argument("--repeats", type=int, default=5, help="paired (loopback, netns) runs per algorithm")
    ap.add_argument("--algorithms", default="fsdp,hsdp,fl_fsdp,fl_hsdp")
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. topology.network.1.gbit_s=0.1")
    args = ap.parse_args()
    algorithms = args.algorithms.split(",")

    start = time.monotonic()
    common = [
        f"topology={args.topology}",
        f"trainer.steps={args.steps}",
        f"algorithm.every={args.every}",
        "wandb.mode=disabled",
        "trainer.progress=false",
        "trainer.eval_batches=1",
        *args.overrides,
    ]
    cfg0 = compose_cfg(*common)
    check_netns(load(cfg0), forks_locally=True)
    samples = paired_samples(cfg0, common, algorithms, args.repeats)
    rows = {a: row(compose_cfg(f"algorithm={a}", *common), samples[a]) for a in algorithms}
    link = cfg0.topology.network[-1]
    print(
        f"{args.topology}: {cfg0.topology.nodes} nodes x {cfg0.topology.procs_per_node} ranks, link "
        f"{link.gbit_s * 1e3:g} Mbit/s each way per node, model={cfg0.model.name}, {args.steps} steps, "
        f"A={args.every}, {args.repeats} paired repeats, {time.monotonic() - start:.0f} s\n"
    )
    print_rows(rows)
    ratios = print_ratios(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"topology": args.topology, "rows": rows, "ratios": ratios}, indent=2))


def paired_samples(cfg0, common: list[str], algorithms: list[str], repeats: int) -> dict:
    """Each algorithm run `repeats` times on loopback and on the namespaces, interleaved: load on
    the machine hits both sides alike."""
    blocks = prepare(cfg0.dataset)
    import fldp.trainer  # noqa: F401  (once here, not in every forked worker)

    samples: dict = {a: {"loopback": [], "netns": []} for a in algorithms}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            for a in algorithms:
                for side in ("loopback", "netns"):
                    # loopback: the same topology, meshes and tiers without the namespaces
                    off = ["topology.emulation=null"] if side == "loopback" else []
                    samples[a][side].append(run(compose_cfg(f"algorithm={a}", *common, *off), blocks, Path(tmp)))
    return samples


def row(cfg, samples: dict) -> dict:
    """One algorithm's medians beside the cost model's prediction of the link's extra."""
    conf = load(cfg)
    _, units = config_model(conf)
    pred, extra = predict_for(conf, units), link_extra(conf, units)
    med = {side: statistics.median(s["step_s"] for s in samples[side]) for side in ("loopback", "netns")}
    return {
        "mesh": str(mesh_shape(cfg)),
        "loopback_s": med["loopback"],
        "netns_s": med["netns"],
        "measured_comm_s": med["netns"] - med["loopback"],
        "predicted_comm_s": extra,
        "gloo_link_s": pred.capped_time(),
        "ring_link_s": pred.capped_time(ring=True),
        "predicted_s": med["loopback"] + extra,
        "samples": samples,
        "link_mb": statistics.median(s["link_bytes"] for s in samples["netns"]) / 1e6,
        "predicted_link_mb": pred.link_bytes() / 1e6,
    }


def print_rows(rows: dict) -> None:
    print(
        "seconds per step; comm = netns - loopback, measured and predicted (the link's time less what the same\n"
        "collectives cost on loopback); the model's time on the link alone, gloo's collectives and a ring's\n"
    )
    print(
        f"{'algorithm':9s} {'mesh':6s} {'loopback':>9s} {'netns':>8s} {'comm meas':>10s} {'comm pred':>10s} "
        f"{'link gloo':>10s} {'link ring':>10s} {'MB/step on link meas':>21s} {'pred':>6s}"
    )
    for a, r in rows.items():
        print(
            f"{NAMES[a]:9s} {r['mesh']:6s} {r['loopback_s']:9.3f} {r['netns_s']:8.3f} {r['measured_comm_s']:10.3f} "
            f"{r['predicted_comm_s']:10.3f} {r['gloo_link_s']:10.3f} {r['ring_link_s']:10.3f} "
            f"{r['link_mb']:21.3f} {r['predicted_link_mb']:6.3f}"
        )


def print_ratios(rows: dict) -> list[dict]:
    """Each algorithm's step against FL+FSDP's, measured and predicted (issue goal: within 15%)."""
    ratios: list[dict] = []
    if "fl_fsdp" not in rows:
        return ratios
    print("\nstep-time ratio            measured  predicted  off by   goal within 15%")
    base = rows["fl_fsdp"]
    for a in ("fsdp", "hsdp", "fl_hsdp"):
        if a not in rows:
            continue
        m, p = rows[a]["netns_s"] / base["netns_s"], rows[a]["predicted_s"] / base["predicted_s"]
        err = m / p - 1
        ratios.append({"ratio": f"{NAMES[a]} / FL+FSDP", "measured": m, "predicted": p, "off_by": err})
        print(
            f"{NAMES[a] + ' / FL+FSDP':25s} {m:8.2f}x {p:9.2f}x {err:+7.1%}   {'MET' if abs(err) <= 0.15 else 'NOT MET'}"
        )
    return ratios


if __name__ == "__main__":
    main()
