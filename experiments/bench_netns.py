"""The cost model against a real capped network (not a timed test): the four algorithms on a netns
topology (emulated nodes, fldp/netns.py) and on plain loopback with the same meshes, paired and
interleaved, then per algorithm

    measured communication per step = step time on netns - step time on loopback
    predicted                       = the cost model's time on the capped tier (fldp.cost, the
                                      topology's network and its gloo calibration)

and the step-time ratios FSDP / FL+FSDP, HSDP / FL+FSDP, FL+HSDP / FL+FSDP, measured against
predicted (= loopback step + predicted communication; goal: within 15%). A step's time is amortised
over A: median of the steps without aggregation + (median of those with it - that) / A, step 1
(start-up) left out. Medians, since this machine's 2 cores are shared.

    python experiments/bench_netns.py [--topology netns_2x4] [--steps 10] [--repeats 2] [--json OUT]
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
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fldp  # noqa: E402,F401
from fldp.cost import ALGORITHMS, model_units, predict_for  # noqa: E402
from fldp.data import load_tokenizer  # noqa: E402
from fldp.mesh import mesh_shape  # noqa: E402
from fldp.model import DTYPES, build_model, llama_config  # noqa: E402

NAMES = {"fsdp": "FSDP", "hsdp": "HSDP", "fl_fsdp": "FL+FSDP", "fl_hsdp": "FL+HSDP"}


def compose_cfg(*overrides):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def step_time(run_dir: Path, every: int | None) -> dict:
    """Amortised step time of one run, and its parts."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("split") is None and r["step"] > 1]
    plain = statistics.median(r["time_step"] for r in rows if not r["aggregated"])
    agg = [r["time_step"] for r in rows if r["aggregated"]]
    extra = statistics.median(agg) - plain if agg and every else 0.0
    return {"plain": plain, "aggregation_extra": extra, "amortised": plain + extra / (every or 1)}


def run(algorithm: str, topology: str, netns: bool, steps: int, every: int, tmp: Path, extra) -> dict:
    run_dir = tmp / f"{algorithm}-{'netns' if netns else 'loopback'}-{time.monotonic_ns()}"
    args = [f"algorithm={algorithm}", f"topology={topology}", f"trainer.steps={steps}",
            f"algorithm.every={every}", "wandb.mode=disabled", "trainer.progress=false",
            "trainer.eval_batches=1", f"hydra.run.dir={run_dir}", *extra]
    if not netns:
        args.append("topology.emulation=null")  # the same topology, meshes and tiers, on loopback
    done = subprocess.run([sys.executable, "-m", "fldp.train", *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"bench_netns: {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["network"] == ("netns" if netns else "loopback"), summary["network"]
    return step_time(run_dir, every if algorithm.startswith("fl_") else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default="netns_2x4")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--every", type=int, default=8, help="A, the aggregation period")
    ap.add_argument("--repeats", type=int, default=2, help="paired (loopback, netns) runs per algorithm")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS))
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. topology.network.1.gbit_s=0.1")
    args = ap.parse_args()
    algorithms = args.algorithms.split(",")

    start = time.monotonic()
    samples = {a: {"loopback": [], "netns": []} for a in algorithms}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):  # interleaved: load on the machine hits both sides alike
            for a in algorithms:
                for netns in (False, True):
                    samples[a]["netns" if netns else "loopback"].append(
                        run(a, args.topology, netns, args.steps, args.every, Path(tmp), args.overrides))

    cfg0 = compose_cfg(f"topology={args.topology}", *args.overrides)
    vocab = cfg0.model.vocab_size or len(load_tokenizer(str(cfg0.dataset.tokenizer)))
    units = model_units(build_model(llama_config(cfg0.model, vocab), "meta"), DTYPES[cfg0.trainer.precision])
    rows = {}
    for a in algorithms:
        cfg = compose_cfg(f"algorithm={a}", f"topology={args.topology}", f"algorithm.every={args.every}", *args.overrides)
        pred = predict_for(cfg, units)
        med = {side: statistics.median(s["amortised"] for s in samples[a][side]) for side in ("loopback", "netns")}
        rows[a] = {"mesh": str(mesh_shape(cfg)), "loopback_s": med["loopback"], "netns_s": med["netns"],
                   "measured_comm_s": med["netns"] - med["loopback"], "predicted_comm_s": pred.capped_time(),
                   "ring_comm_s": pred.capped_time(ring=True),
                   "predicted_s": med["loopback"] + pred.capped_time(), "samples": samples[a]}
    link = cfg0.topology.network[-1]
    print(f"{args.topology}: {cfg0.topology.nodes} nodes x {cfg0.topology.procs_per_node} ranks, link "
          f"{link.gbit_s * 1e3:g} Mbit/s each way per node, model={cfg0.model.name}, {args.steps} steps, "
          f"A={args.every}, {args.repeats} paired repeats, {time.monotonic() - start:.0f} s\n")
    print(f"{'algorithm':9s} {'mesh':6s} {'loopback':>9s} {'netns':>8s} {'comm meas':>10s} {'comm pred':>10s} "
          f"{'ring-only':>10s}   per step [s]")
    for a, r in rows.items():
        print(f"{NAMES[a]:9s} {r['mesh']:6s} {r['loopback_s']:9.3f} {r['netns_s']:8.3f} {r['measured_comm_s']:10.3f} "
              f"{r['predicted_comm_s']:10.3f} {r['ring_comm_s']:10.3f}")
    ratios = []
    if "fl_fsdp" in rows:
        print("\nstep-time ratio            measured  predicted  off by   goal within 15%")
        base = rows["fl_fsdp"]
        for a in ("fsdp", "hsdp", "fl_hsdp"):
            if a not in rows:
                continue
            m, p = rows[a]["netns_s"] / base["netns_s"], rows[a]["predicted_s"] / base["predicted_s"]
            err = m / p - 1
            ratios.append({"ratio": f"{NAMES[a]} / FL+FSDP", "measured": m, "predicted": p, "off_by": err})
            print(f"{NAMES[a] + ' / FL+FSDP':25s} {m:8.2f}x {p:9.2f}x {err:+7.1%}   {'MET' if abs(err) <= 0.15 else 'NOT MET'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"topology": args.topology, "rows": rows, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
