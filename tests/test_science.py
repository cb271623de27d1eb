"""The tiny study (issue 12): the paper-shaped topology, the statistics against published t-table
values and hand computation, and analysis/science.py on synthetic records whose verdicts are known
by construction. (The study's real runs: experiments/science.sh, run reduced in CI.)"""
import math
import statistics

import pandas as pd
import pytest

from analysis import paper
from analysis.records import make_run
from analysis.science import Study, batch_control, best_lrs, drift, findings, frontier, report
from analysis.stats import mean_interval, paired_ratio, t_quantile
from conftest import compose_cfg
from fldp.records import ANALYSED_FIELDS

ALGOS = ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp")


def meshes(*overrides):
    out = {}
    for algo in ALGOS:
        m = compose_cfg(f"algorithm={algo}", *overrides).mesh
        out[algo] = (m.federation, m.replicate, m.shard)
    return out


@pytest.mark.parametrize("overrides", [("topology=local_4x2",), ("topology=netns_4x2",), ("+experiment=tiny_repro",),
                                       ("+experiment=science",)])
def test_paper_shaped_topology(overrides):
    """The paper's relations (512 GPUs: FSDP 1x1x512, HSDP 1x128x4, FL+FSDP 128x1x4, FL+HSDP 16x8x4)
    at 8 ranks: FL+FSDP's F > FL+HSDP's F > 1, HSDP's R = FL+FSDP's F, one S for HSDP and both FL,
    FSDP over the whole pool; the tiny reproduction and the study use it."""
    m = meshes(*overrides)
    assert m["fsdp"] == (1, 1, 8)
    assert m["fl_fsdp"][0] > m["fl_hsdp"][0] > 1
    assert m["hsdp"][1] == m["fl_fsdp"][0] and m["hsdp"][0] == 1
    assert m["hsdp"][2] == m["fl_fsdp"][2] == m["fl_hsdp"][2] < 8
    paper_512 = meshes("topology=leonardo_512")
    for algo in ALGOS:  # the same relations as the paper's own layouts
        assert (paper_512[algo][0] > 1) == (m[algo][0] > 1) and (paper_512[algo][1] > 1) == (m[algo][1] > 1)


@pytest.mark.parametrize("df, table", [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (29, 2.045)])
def test_t_quantile_matches_the_published_table(df, table):
    assert t_quantile(0.975, df) == pytest.approx(table, abs=1e-3)


def test_paired_ratio_from_the_definition():
    d = [0.1, -0.05, 0.2, 0.0, 0.15]  # per-seed log ratios
    b = pd.Series([100.0, 200.0, 300.0, 400.0, 500.0])
    a = b * [math.exp(x) for x in d]
    r = paired_ratio(a, b)
    half = 2.776 * statistics.stdev(d) / math.sqrt(5)
    assert r.ratio == pytest.approx(math.exp(statistics.mean(d)))
    assert (r.low, r.high) == (pytest.approx(math.exp(0.08 - half), rel=1e-4), pytest.approx(math.exp(0.08 + half), rel=1e-4))
    assert r.verdict == "inconclusive"  # 0.08 +- 0.12: the interval holds 1 and reaches far beyond the band
    assert paired_ratio(b * 2, b).verdict == ">" and paired_ratio(b, b * 2).verdict == "<"
    assert paired_ratio(b.iloc[:1], b.iloc[:1]).verdict == "n/a"
    # consistent but tiny (0.1-0.2%): inside the 1% tie band, not a finding
    tiny = paired_ratio(b * [1.001, 1.002, 1.0015, 1.001, 1.002], b)
    assert tiny.low > 1 and tiny.verdict == "tie"
    # the band is the two within 1% of the larger, as analysis/claims.py's: 0.990 to 1/0.990
    assert paired_ratio(b * 0.991, b).verdict == "tie" and paired_ratio(b * 0.989, b).verdict == "<"
    assert paired_ratio(b / 0.991, b).verdict == "tie" and paired_ratio(b / 0.989, b).verdict == ">"
    # pairing is by seed (the index): a seed on one side only is left out
    assert paired_ratio(pd.Series([2.0, 4.0], index=[0, 7]), pd.Series([1.0, 1.0], index=[0, 1])).seeds == 1
    m, lo, hi = mean_interval(pd.Series([1.0, 2.0, 3.0]))
    assert (m, hi - m) == (2.0, pytest.approx(4.303 * 1.0 / math.sqrt(3), rel=1e-4))


def _run(algo, seed, ppl, *, precision="fp32", lr=1e-2, every=8, steps=8, mesh=None, network="loopback",
         time_s=1.0, reduce_dtype=None, loss_shift=0.0):
    F, R, S = mesh or {"fsdp": (1, 1, 8), "hsdp": (1, 4, 2), "fl_fsdp": (4, 1, 2), "fl_hsdp": (2, 2, 2)}[algo]
    rows = [{"step": i, "loss": 5.0 - 0.01 * i + loss_shift, "perplexity": 100.0, **{f: 0.0 for f in ANALYSED_FIELDS
            if f.startswith("time_")}, "time_step": time_s / steps, "aggregated": False} for i in range(1, steps + 1)]
    summary = {"algorithm": algo, "seed": seed, "steps": steps, "federation": F, "replicate": R, "shard": S,
               "world_size": F * R * S, "batch_size": 2, "precision": precision, "every": every if F > 1 else None,
               "outer": {"reduce_dtype": reduce_dtype} if F > 1 else None, "network": network,
               "eval_perplexity": ppl, "eval_time_s": 0.1, "train_time_s": time_s, "train_perplexity": ppl}
    return make_run(f"{algo}-{seed}-{precision}-{lr}-{steps}-{F}x{R}x{S}-{every}-{network}", summary, rows,
                    {"optimizer": {"lr": lr}, "trainer": {"steps": steps}})


def synthetic():
    """5 seeds; FL+HSDP clearly below HSDP and FSDP; FSDP = HSDP exactly in fp32, HSDP 1.1x in bf16
    (with noise); FL+FSDP ties FSDP; a batch control below FL+FSDP; lr 3e-3 best for FL+FSDP only."""
    runs = []
    for s in range(5):
        noise = 1 + 0.01 * (s - 2)
        base = {"fsdp": 500.0, "hsdp": 500.0, "fl_fsdp": 500.0 * (1 + 0.02 * (-1) ** s), "fl_hsdp": 300.0}
        for algo, ppl in base.items():
            runs.append(_run(algo, s, ppl * noise, network="netns", time_s={"fsdp": 40, "hsdp": 20}.get(algo, 10)))
            runs.append(_run(algo, s, ppl * noise * (1.1 + 0.01 * s if algo == "hsdp" else 1.0), precision="bf16",
                             loss_shift=0.05 if algo == "hsdp" else 0.0))
            runs.append(_run(algo, s, ppl * noise * (0.8 if algo == "fl_fsdp" else 1.2), lr=3e-3))
        runs.append(_run("fsdp", s, 400.0 * noise, mesh=(1, 1, 2)))              # batch-matched, FL+FSDP's group
        runs.append(_run("fsdp", s, 350.0 * noise, mesh=(1, 1, 2), steps=32))    # token-matched (F = 4)
        runs.append(_run("fl_fsdp", s, 450.0 * noise, every=1, network="netns", time_s=30))
    return runs


def test_verdicts_on_synthetic_records():
    st = Study(synthetic())
    assert (st.lr, st.steps, st.every, st.world) == (1e-2, 8, 8, 8)
    f = findings(st, paper.load()).set_index(["finding", "setting"])
    v = f["verdict"]
    assert v["FL+HSDP reaches a lower eval perplexity than HSDP", "fp32, shared lr"] == "reproduced"
    # FL+FSDP / FSDP: 1 +- 2% by seed, an interval from 0.97 to 1.02 ...
    assert v["FL+FSDP reaches a lower eval perplexity than FSDP", "fp32, shared lr"] == \
        "not reproduced: inconclusive (interval spans the tie band)"
    # ... HSDP = FSDP exactly: [1, 1]
    assert v["HSDP ends with a higher eval perplexity than FSDP", "fp32, shared lr"] == \
        "not reproduced: tie (interval within 0.990-1.010)"
    assert v["HSDP ends with a higher eval perplexity than FSDP", "bf16, shared lr"] == "reproduced"
    # at each one's best lr FL+FSDP (best 3e-3: 0.8x) now beats FSDP (best 1e-2)
    assert best_lrs(st) == {"fsdp": 1e-2, "hsdp": 1e-2, "fl_fsdp": 3e-3, "fl_hsdp": 1e-2}
    assert v["FL+FSDP reaches a lower eval perplexity than FSDP", "fp32, each one's best lr"] == "reproduced"
    timing = f[f.index.get_level_values(1).str.contains("netns")]
    assert list(timing["verdict"]) == ["reproduced", "reproduced", "not reproduced: tie (interval within 0.990-1.010)"]
    assert timing["runs [95% CI]"].iloc[0].startswith("4.000")
    d = drift(st).set_index("comparison")
    assert d.loc["HSDP vs FSDP, fp32", "max abs train-loss difference (any step)"] == "0.00e+00"
    assert d.loc["HSDP vs FSDP, bf16", "at the last step (mean)"] == "5.00e-02"
    b = batch_control(st)
    fl_fsdp = b[b["FL run"].str.startswith("FL+FSDP")].set_index("control")["verdict"]
    assert list(fl_fsdp) == ["inconclusive (interval spans the tie band)", "control lower", "control lower"]
    fr, network = frontier(st)
    assert network == "netns"
    assert set(zip(fr["algorithm"], fr["A"])) == {("FSDP", "-"), ("HSDP", "-"), ("FL+FSDP", 1), ("FL+FSDP", 8),
                                                  ("FL+HSDP", 8)}
    # relative to FSDP in the same seed: 450 / 500 for every seed, however much the seeds differ
    assert fr.set_index(["algorithm", "A"]).loc[("FL+FSDP", 1), "/ FSDP"] == pytest.approx(0.9)


def test_report_writes_every_part(tmp_path):
    path = report(Study(synthetic()), paper.load(), tmp_path, "test", 60.0)
    text = path.read_text()
    for heading in ("## The paper's findings", "## Precision", "## Batch-matched control", "## Learning rate",
                    "## Perplexity against time"):
        assert heading in text
    assert (tmp_path / "frontier.png").stat().st_size > 0 and (tmp_path / "drift.png").exists()
    assert "1.0 min" in text
