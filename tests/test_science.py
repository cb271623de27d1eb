"""The tiny study (issue 12): the paper-shaped topology, the statistics against published t-table
values and hand computation, and its spec (experiments/science/study.yaml: its families and the
pieces of analysis/science_pieces.py) on synthetic records whose verdicts are known by construction.
(The study's real runs: `fldp-study run experiments/science --reduced` in CI; its committed numbers
made again: tests/test_study.py.)"""

import math
import statistics

import pandas as pd
import pytest
from conftest import ROOT, compose_cfg

from analysis import paper
from analysis.records import make_run
from analysis.spec import load
from analysis.stats import (
    TOO_FEW,
    Claim,
    direction,
    explore,
    holm_levels,
    judge,
    mean_interval,
    paired_ratio,
    size,
    t_quantile,
)
from fldp.records import ANALYSED_FIELDS

ALGOS = ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp")


def meshes(*overrides):
    out = {}
    for algo in ALGOS:
        m = compose_cfg(f"algorithm={algo}", *overrides).mesh
        out[algo] = (m.federation, m.replicate, m.shard)
    return out


@pytest.mark.parametrize(
    "overrides",
    [("topology=local_4x2",), ("topology=netns_4x2",), ("+experiment=tiny_repro",), ("+experiment=science",)],
)
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
    assert (r.low, r.high) == (
        pytest.approx(math.exp(0.08 - half), rel=1e-4),
        pytest.approx(math.exp(0.08 + half), rel=1e-4),
    )
    assert r.verdict == "inconclusive"  # 0.08 +- 0.12: the interval holds 1 and reaches far beyond the band
    assert paired_ratio(b * 2, b).verdict == ">" and paired_ratio(b, b * 2).verdict == "<"
    assert paired_ratio(b.iloc[:1], b.iloc[:1]).verdict == "n/a"
    # two seeds that agree (ratio 2 and 3) are no verdict: that happens 1 time in 4 with no effect
    two = paired_ratio(b.iloc[:2] * [2, 3], b.iloc[:2])
    assert two.verdict == "n/a" and direction(two, 2.0) == TOO_FEW and size(two, 2.0) == "n/a"
    assert paired_ratio(b.iloc[:3] * [2, 3, 2.5], b.iloc[:3]).verdict == ">"
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


def test_holm_and_the_plain_level():
    """A claim whose plain 95% interval excludes the band, but whose Holm-corrected one does not,
    is reproduced when explored and inconclusive when judged in its family."""
    b = pd.Series([100.0, 200.0, 300.0, 400.0, 500.0])
    strong = Claim("strong", b * 2, b, 2.0)
    marginal = Claim("marginal", b * [1.08, 1.02, 1.10, 1.03, 1.06], b, 1.5)  # p 0.017
    alone = explore([marginal]).iloc[0]
    assert alone["level"] == 0.95 and alone["direction"] == "reproduced"
    # 4 claims: marginal ranks 2nd of 4, judged at alpha / 3: its interval then reaches into the band
    family = judge(
        [
            strong,
            marginal,
            Claim("null1", b * [1.1, 0.9, 1.0, 1.05, 0.95], b, 2.0),
            Claim("null2", b * [0.9, 1.1, 1.0, 0.95, 1.05], b, 2.0),
        ]
    ).set_index("claim")
    assert family.loc["marginal", "direction_level"] == pytest.approx(1 - 0.05 / 3)
    assert family.loc["marginal", "level"] == pytest.approx(1 - 0.05 / 4)  # shown: Bonferroni, simultaneous
    assert family.loc["marginal", "direction"] == "inconclusive"
    assert family.loc["strong", "direction"] == "reproduced" and family.loc["strong", "size"] == "paper's value inside"
    assert family.loc["marginal", "size"] == "effect size refuted at this scale"  # 1.5 is far outside
    # step-down: each rejection relaxes the next threshold; the first failure ends it (alpha / m after)
    assert holm_levels([0.001, 0.02, 0.5]) == pytest.approx([1 - 0.05 / 3, 1 - 0.05 / 2, 0.95])
    assert holm_levels([0.001, 0.03, 0.04]) == pytest.approx([1 - 0.05 / 3, 1 - 0.05 / 2, 1 - 0.05 / 3])


SCIENCE = ROOT / "experiments" / "science"
MESHES = {"fsdp": (1, 1, 8), "hsdp": (1, 4, 2), "fl_fsdp": (4, 1, 2), "fl_hsdp": (2, 2, 2)}


def _run(phase, point, algo, seed, ppl, *, precision="fp32", lr=1e-2, every=8, steps=8, mesh=None, time_s=1.0, loss_shift=0.0):  # fmt: skip
    """A finished run of the spec's phase at the sweep point `point` (its directory's overrides)."""
    F, R, S = mesh or MESHES[algo]
    rows = [
        {
            "step": i,
            "loss": 5.0 - 0.01 * i + loss_shift,
            "perplexity": 100.0,
            **{f: 0.0 for f in ANALYSED_FIELDS if f.startswith("time_")},
            "time_step": time_s / steps,
            "aggregated": False,
        }
        for i in range(1, steps + 1)
    ]
    summary = {
        "algorithm": algo, "seed": seed, "steps": steps, "federation": F, "replicate": R, "shard": S,
        "world_size": F * R * S, "batch_size": 2, "precision": precision, "every": every if F > 1 else None,
        "eval_perplexity": ppl, "eval_loss": math.log(ppl), "eval_time_s": 0.1, "train_time_s": time_s,
        "train_perplexity": ppl,
    }  # fmt: skip
    name = f"/x/runs/{phase}/+experiment=science,{point},seed={seed}"
    return make_run(name, summary, rows, {"optimizer": {"lr": lr}, "trainer": {"steps": steps}})


def synthetic():
    """5 seeds; FL+HSDP clearly below HSDP and FSDP; FSDP = HSDP exactly in fp32, HSDP 1.1x in bf16
    (with noise); FL+FSDP ties FSDP; a batch control below FL+FSDP; lr 3e-3 best for FL+FSDP only."""
    runs = []
    for s in range(5):
        noise = 1 + 0.01 * (s - 2)
        base = {"fsdp": 500.0, "hsdp": 500.0, "fl_fsdp": 500.0 * (1 + 0.02 * (-1) ** s), "fl_hsdp": 300.0}
        for algo, ppl in base.items():
            time_s = {"fsdp": 40, "hsdp": 20}.get(algo, 10)
            runs.append(_run("tiny_repro", f"algorithm={algo},topology=netns_4x2", algo, s, ppl * noise, time_s=time_s))
            bf16 = ppl * noise * (1.1 + 0.01 * s if algo == "hsdp" else 1.0)
            shift = 0.05 if algo == "hsdp" else 0.0
            point = f"algorithm={algo},trainer.precision=bf16"
            runs.append(_run("bf16", point, algo, s, bf16, precision="bf16", loss_shift=shift))
            low = ppl * noise * (0.8 if algo == "fl_fsdp" else 1.2)
            runs.append(_run("lr", f"algorithm={algo},optimizer.lr=0.003", algo, s, low, lr=3e-3))
        point = "algorithm=fsdp,topology=local_2"  # one FL+FSDP group's batch: as many steps, and F times as many
        runs.append(_run("batch_fl_fsdp", point, "fsdp", s, 400.0 * noise, mesh=(1, 1, 2)))
        runs.append(
            _run("batch_fl_fsdp", point + ",trainer.steps=128", "fsdp", s, 350.0 * noise, mesh=(1, 1, 2), steps=32)
        )
        point = "algorithm.every=1,algorithm=fl_fsdp,topology=netns_4x2"
        runs.append(_run("frontier", point, "fl_fsdp", s, 450.0 * noise, every=1, time_s=30))
    return runs


def test_verdicts_on_synthetic_records(tmp_path):
    """The spec's report on runs whose verdicts are known: the primary family judged (simultaneous
    intervals, Holm's directions), every other comparison explored, and the controls."""
    from analysis.study import frame
    from analysis.study_report import report

    study = load(SCIENCE)
    report(frame(synthetic(), study), study, paper.load(), tmp_path, "test", 60.0, tmp_path / "runs")
    found = pd.read_csv(tmp_path / "findings.csv")
    primary = found[found["family"] == study.families[0].name].set_index("claim")
    assert len(primary) == 5 and list(primary["level"]) == pytest.approx([1 - 0.05 / 5] * 5)
    assert list(primary["direction_level"]) == pytest.approx(holm_levels(list(primary["p"])))
    assert (found.loc[found["family"] != study.families[0].name, "level"] == 0.95).all()
    d = primary["direction"]
    assert d["FL+HSDP reaches a lower eval perplexity than HSDP"] == "reproduced"
    assert (
        primary.loc["FL+HSDP reaches a lower eval perplexity than HSDP", "size"] == "effect size refuted at this scale"
    )
    assert d["FL+FSDP reaches a lower eval perplexity than FSDP"] == "inconclusive"  # 1 +- 2% by seed
    assert d["HSDP ends with a higher eval perplexity than FSDP"] == "tie"  # HSDP = FSDP exactly: [1, 1]
    v = found.set_index(["family", "claim"])["direction"]
    assert v["bf16, shared lr 0.01", "HSDP ends with a higher eval perplexity than FSDP"] == "reproduced"
    # at each one's best lr FL+FSDP (best 3e-3: 0.8x) now beats FSDP (best 1e-2): explored only
    best = "fp32, each one's best lr (picked on these seeds)"
    assert v[best, "FL+FSDP reaches a lower eval perplexity than FSDP"] == "reproduced"
    assert list(pd.read_csv(tmp_path / "lr.csv")["best lr"]) == [0.01, 0.01, 0.003, 0.01]
    timing = found[found["family"] == "fp32, shared lr, netns network"]
    assert list(timing["direction"]) == ["reproduced", "reproduced", "tie"] and timing["ratio"].iloc[
        0
    ] == pytest.approx(4.0)
    drift = pd.read_csv(tmp_path / "drift.csv", dtype=str).set_index("comparison")
    assert drift.loc["HSDP vs FSDP, fp32", "max abs train-loss difference (any step)"] == "0.00e+00"
    assert drift.loc["HSDP vs FSDP, bf16", "at the last step (mean)"] == "5.00e-02"
    b = pd.read_csv(tmp_path / "batch_control.csv")
    fl_fsdp = b[b["FL run"].str.startswith("FL+FSDP")]["direction (exploratory)"]
    assert list(fl_fsdp) == ["inconclusive (interval spans the tie band)", "control lower", "control lower"]
    assert b["control"].str.startswith("token-matched").sum() == 1
    fr = pd.read_csv(tmp_path / "frontier.csv", dtype={"A": str})
    assert set(zip(fr["algorithm"], fr["A"])) == {("FSDP", "-"), ("HSDP", "-"), ("FL+FSDP", "1"), ("FL+FSDP", "8"), ("FL+HSDP", "8")}  # fmt: skip
    # relative to FSDP in the same seed: 450 / 500 for every seed, however much the seeds differ
    assert fr.set_index(["algorithm", "A"]).loc[("FL+FSDP", "1"), "/ FSDP"] == pytest.approx(0.9)
    by_lr = pd.read_csv(tmp_path / "findings_by_lr.csv").set_index("claim")
    assert list(by_lr.columns) == ["paper", "lr 0.003", "lr 0.01 (shared)"]  # lr 0.03 not run: no column
    row = by_lr.loc["FL+FSDP reaches a lower eval perplexity than FSDP"]
    assert row["lr 0.01 (shared)"].endswith("inconclusive") and row["lr 0.003"].startswith(
        "1.494"
    )  # 1.2 / 0.8 x (1 + 2%)
    text = (tmp_path / "report.md").read_text()
    assert "1.0 min" in text and (tmp_path / "frontier.png").stat().st_size > 0 and (tmp_path / "drift.png").exists()
    assert "Tables 3-4 (tiny_repro)" in text  # not made: no run directory


def test_too_few_seeds_give_no_verdict(tmp_path):
    """With 2 seeds (CI's reduced study has 1) every direction is n/a, even where both seeds agree by far
    (FL+HSDP 300 against HSDP 500)."""
    from analysis.study import findings, frame

    study = load(SCIENCE)
    found = findings(frame([r for r in synthetic() if r.seed < 2], study), study, paper.load())
    assert (found["direction"] == TOO_FEW).all() and (found["size"] == "n/a").all()
    assert found.loc[0, "ratio"] == pytest.approx(500 / 300)


def test_a_run_with_a_schedule_is_a_point_of_its_own_on_the_frontier():
    """algorithm.every as a schedule ([[0, 1], [4, 8]]): read, and its own point (it crashed the
    study once: int(list))."""
    from analysis.science_pieces import frontier
    from analysis.study import frame

    study = load(SCIENCE)
    runs = synthetic()
    point = "algorithm.every=[[0,1],[4,8]],algorithm=fl_fsdp,topology=netns_4x2"
    runs += [_run("frontier", point, "fl_fsdp", s, 480.0, every=[[0, 1], [4, 8]]) for s in range(5)]
    fr = frontier(frame(runs, study), ["tiny_repro", "frontier"])
    assert "[[0, 1], [4, 8]]" in set(fr["A"]) and 8 in set(fr["A"])


def test_the_frontier_figure_draws_every_point_and_label_apart():
    """The committed study's frontier (5 A at F = 4 and at F = 2, FSDP and HSDP): no A label over
    another, and HSDP, at the time of FL+FSDP's A = 1, drawn as its own marker on top."""
    from analysis.science_pieces import frontier_figure

    table = pd.read_csv(SCIENCE / "frontier.csv", dtype={"A": str})
    fig = frontier_figure(table, "netns")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        boxes = [t.get_window_extent(renderer) for t in ax.texts]
        assert len(boxes) == 5
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :]), ax.get_title()
        baselines = {line.get_label(): line for line in ax.lines if line.get_label() in ("FSDP", "HSDP")}
        assert set(baselines) == {"FSDP", "HSDP"} and all(line.get_zorder() > 2 for line in baselines.values())
