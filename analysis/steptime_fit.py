"""The step-time model (fldp/steptime.py) beside the paper's Table 4: its four free terms fitted
to the phase times of three rows, the fourth predicted (leave one out), and fitted to all four.

    python -m analysis.steptime_fit            # a Markdown table (docs/communication.md)

Fitted by least squares on the log of predicted / measured over each row's forward, backward and
aggregation (the optimizer's 0.03 s and the zeros carry no information on the free terms).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import least_squares

from fldp.mesh import MeshShape
from fldp.steptime import Efficiency, Hardware, Workload, phases, workload_for

from . import paper

PHASES = ("forward", "backward", "optimizer", "aggregation")
FITTED = ("forward", "backward", "aggregation")
# the authors' layouts on leonardo_512 (F, R, S) and A
LAYOUTS = {"fsdp": (1, 1, 512, None), "hsdp": (1, 128, 4, None), "fl_fsdp": (128, 1, 4, 8), "fl_hsdp": (16, 8, 4, 8)}


def table4() -> dict[str, dict[str, float]]:
    t = paper.load()["table4"]
    return {a: dict(zip(t["columns"], row)) for a, row in t["mean"].items()}


def workload() -> Workload:
    """Llama 3.1 8B in bf16, 2 x 2,048 tokens per GPU, its FSDP units."""
    from hydra import compose, initialize_config_dir

    from fldp import CONF
    from fldp.config import load

    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["topology=leonardo_512", "model=llama3_1_8b"])
    return workload_for(load(cfg))


LEONARDO = Hardware()  # the published figures (fldp/steptime.py)


def predict(work: Workload, name: str, eff: Efficiency) -> dict[str, float]:
    F, R, S, A = LAYOUTS[name]
    return phases(work, MeshShape(F, R, S), A, LEONARDO, eff)


def fit(work: Workload, measured: dict, names: list[str]) -> Efficiency:
    """The free terms that best match the rows `names` (log errors of their nonzero phases)."""

    def residuals(x):
        eff = Efficiency(*x)
        out = []
        for name in names:
            got = predict(work, name, eff)
            out += [math.log(got[p] / measured[name][p]) for p in FITTED if measured[name][p] > 0 and got[p] > 0]
        return np.array(out)

    # the latency's multiple starts at NCCL's own model (1) and never goes below it: without a long
    # ring across nodes (FSDP's row) nothing else identifies it
    found = least_squares(residuals, x0=[0.5, 0.5, 0.05, 1.0], bounds=([0.05, 0.01, 0.0, 1.0], [1.0, 1.0, 1.0, 100.0]))
    return Efficiency(*found.x)


def rows() -> list[dict]:
    work, measured = workload(), table4()
    out = []
    for name in LAYOUTS:
        others = [n for n in LAYOUTS if n != name]
        for label, eff in (("left out", fit(work, measured, others)), ("all four", fit(work, measured, list(LAYOUTS)))):
            got = predict(work, name, eff)
            overall = sum(got.values())
            out.append(
                {
                    "algorithm": name,
                    "fit": label,
                    **{p: got[p] for p in PHASES},
                    "overall": overall,
                    "measured": measured[name]["overall"],
                    "error": overall / measured[name]["overall"] - 1,
                    "compute": eff.compute,
                    "network": eff.network,
                    "span": eff.span,
                    "latency": eff.latency,
                }
            )
    return out


def markdown(found: list[dict]) -> str:
    measured = table4()
    lines = [
        "| algorithm | fit | forward | backward | optimizer | aggregation | overall | paper | error | "
        "compute, network, span, latency |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in found:
        paper = measured[r["algorithm"]]
        cells = [f"{r[p]:.2f} ({paper[p]:.2f})" for p in PHASES]
        lines.append(
            f"| {r['algorithm']} | {r['fit']} | " + " | ".join(cells) + f" | {r['overall']:.2f} | "
            f"{r['measured']:.2f} | {r['error']:+.0%} | {r['compute']:.2f}, {r['network']:.2f}, {r['span']:.2f}, {r['latency']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(rows()))
