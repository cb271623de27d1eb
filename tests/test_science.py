"""The tiny study (issue 12): the paper-shaped topology, the statistics against published t-table
values and hand computation, and analysis/science.py on synthetic records whose verdicts are known
by construction. (The study's real runs: experiments/science.sh, run reduced in CI.)"""

import math
import statistics

import pandas as pd
import pytest
from conftest import ROOT, compose_cfg

from analysis import paper
from analysis.records import make_run
from analysis.science import RUN_COLUMNS, Study, batch_control, best_lrs, by_lr, drift, findings, frontier, report
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


def _run(
    algo,
    seed,
    ppl,
    *,
    precision="fp32",
    lr=1e-2,
    every=8,
    steps=8,
    mesh=None,
    network="loopback",
    time_s=1.0,
    reduce_dtype=None,
    loss_shift=0.0,
):
    F, R, S = mesh or {"fsdp": (1, 1, 8), "hsdp": (1, 4, 2), "fl_fsdp": (4, 1, 2), "fl_hsdp": (2, 2, 2)}[algo]
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
        "algorithm": algo,
        "seed": seed,
        "steps": steps,
        "federation": F,
        "replicate": R,
        "shard": S,
        "world_size": F * R * S,
        "batch_size": 2,
        "precision": precision,
        "every": every if F > 1 else None,
        "outer": {"reduce_dtype": reduce_dtype} if F > 1 else None,
        "network": network,
        "eval_perplexity": ppl,
        "eval_time_s": 0.1,
        "train_time_s": time_s,
        "train_perplexity": ppl,
    }
    return make_run(
        f"{algo}-{seed}-{precision}-{lr}-{steps}-{F}x{R}x{S}-{every}-{network}",
        summary,
        rows,
        {"optimizer": {"lr": lr}, "trainer": {"steps": steps}},
    )


def synthetic():
    """5 seeds; FL+HSDP clearly below HSDP and FSDP; FSDP = HSDP exactly in fp32, HSDP 1.1x in bf16
    (with noise); FL+FSDP ties FSDP; a batch control below FL+FSDP; lr 3e-3 best for FL+FSDP only."""
    runs = []
    for s in range(5):
        noise = 1 + 0.01 * (s - 2)
        base = {"fsdp": 500.0, "hsdp": 500.0, "fl_fsdp": 500.0 * (1 + 0.02 * (-1) ** s), "fl_hsdp": 300.0}
        for algo, ppl in base.items():
            runs.append(_run(algo, s, ppl * noise, network="netns", time_s={"fsdp": 40, "hsdp": 20}.get(algo, 10)))
            runs.append(
                _run(
                    algo,
                    s,
                    ppl * noise * (1.1 + 0.01 * s if algo == "hsdp" else 1.0),
                    precision="bf16",
                    loss_shift=0.05 if algo == "hsdp" else 0.0,
                )
            )
            runs.append(_run(algo, s, ppl * noise * (0.8 if algo == "fl_fsdp" else 1.2), lr=3e-3))
        runs.append(_run("fsdp", s, 400.0 * noise, mesh=(1, 1, 2)))  # batch-matched, FL+FSDP's group
        runs.append(_run("fsdp", s, 350.0 * noise, mesh=(1, 1, 2), steps=32))  # token-matched (F = 4)
        runs.append(_run("fl_fsdp", s, 450.0 * noise, every=1, network="netns", time_s=30))
    return runs


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


def test_verdicts_on_synthetic_records():
    st = Study(synthetic())
    assert (st.lr, st.steps, st.every, st.world) == (1e-2, 8, 8, 8)
    found = findings(st, paper.load())
    primary = found[found["family"] == "primary"].set_index("claim")
    # the primary family: the five perplexity claims at the shared lr, fp32, Holm-corrected together
    assert len(primary) == 5 and set(primary["setting"]) == {"fp32, shared lr 0.01"}
    assert list(primary["direction_level"]) == pytest.approx(holm_levels(list(primary["p"])))
    assert list(primary["level"]) == pytest.approx([1 - 0.05 / 5] * 5)  # the shown intervals: simultaneous
    assert (primary["level"] > 0.95).all() and (found.loc[found["family"] == "exploratory", "level"] == 0.95).all()
    d = primary["direction"]
    assert d["FL+HSDP reaches a lower eval perplexity than HSDP"] == "reproduced"
    assert (
        primary.loc["FL+HSDP reaches a lower eval perplexity than HSDP", "size"] == "effect size refuted at this scale"
    )
    # FL+FSDP / FSDP: 1 +- 2% by seed, an interval from 0.96 to 1.03 ...
    assert d["FL+FSDP reaches a lower eval perplexity than FSDP"] == "inconclusive"
    # ... HSDP = FSDP exactly: [1, 1]
    assert d["HSDP ends with a higher eval perplexity than FSDP"] == "tie"
    v = found[found["family"] == "exploratory"].set_index(["claim", "setting"])["direction"]
    assert v["HSDP ends with a higher eval perplexity than FSDP", "bf16, shared lr 0.01"] == "reproduced"
    # at each one's best lr FL+FSDP (best 3e-3: 0.8x) now beats FSDP (best 1e-2): exploratory only
    assert best_lrs(st) == {"fsdp": 1e-2, "hsdp": 1e-2, "fl_fsdp": 3e-3, "fl_hsdp": 1e-2}
    assert (
        v["FL+FSDP reaches a lower eval perplexity than FSDP", "fp32, each one's best lr (picked on these seeds)"]
        == "reproduced"
    )
    timing = found[found["setting"].str.contains("netns")]
    assert list(timing["direction"]) == ["reproduced", "reproduced", "tie"]
    assert set(timing["family"]) == {"exploratory"} and timing["runs [CI]"].iloc[0].startswith("4.000")
    d = drift(st).set_index("comparison")
    assert d.loc["HSDP vs FSDP, fp32", "max abs train-loss difference (any step)"] == "0.00e+00"
    assert d.loc["HSDP vs FSDP, bf16", "at the last step (mean)"] == "5.00e-02"
    b = batch_control(st)
    fl_fsdp = b[b["FL run"].str.startswith("FL+FSDP")].set_index("control")["direction (exploratory)"]
    assert list(fl_fsdp) == ["inconclusive (interval spans the tie band)", "control lower", "control lower"]
    fr, network = frontier(st)
    assert network == "netns"
    assert set(zip(fr["algorithm"], fr["A"])) == {
        ("FSDP", "-"),
        ("HSDP", "-"),
        ("FL+FSDP", 1),
        ("FL+FSDP", 8),
        ("FL+HSDP", 8),
    }
    # relative to FSDP in the same seed: 450 / 500 for every seed, however much the seeds differ
    assert fr.set_index(["algorithm", "A"]).loc[("FL+FSDP", 1), "/ FSDP"] == pytest.approx(0.9)


def test_every_lr_of_the_grid_is_paired():
    """The five claims at each lr (every algorithm at it): FL+FSDP / FSDP is inconclusive at the
    shared 1e-2 and reproduced at 3e-3 (0.8 x 500 against 1.2 x 500)."""
    st = Study(synthetic())
    table = by_lr(st, paper.load()).set_index("claim")
    assert list(table.columns) == ["paper", "lr 0.003", "lr 0.01 (shared)"]
    row = table.loc["FL+FSDP reaches a lower eval perplexity than FSDP"]
    assert row["lr 0.01 (shared)"].endswith("inconclusive") and row["lr 0.003"].endswith("reproduced")
    assert row["lr 0.003"].startswith("1.494")  # 1.2 / 0.8 x (1 + 2%) by seed: the geometric mean
    found = findings(st, paper.load())
    assert "fp32, lr 0.003 (all)" in set(found.loc[found["family"] == "exploratory", "setting"])


def test_too_few_seeds_give_no_verdict(tmp_path):
    """With 2 seeds (CI's reduced study has 1) every direction is n/a, even where both seeds agree by far
    (FL+HSDP 300 against HSDP 500), and the report says so instead of failing."""
    st = Study([r for r in synthetic() if r.seed < 2])
    found = findings(st, paper.load())
    assert (found["direction"] == TOO_FEW).all() and (found["size"] == "n/a").all()
    primary = found[found["family"] == "primary"].set_index("claim")
    assert primary.loc["FL+HSDP reaches a lower eval perplexity than HSDP", "ratio"] == pytest.approx(500 / 300)
    text = report(st, paper.load(), tmp_path, "test", None).read_text()
    primary_md = text.split("## The primary family")[1].split("## What holds")[0]
    assert "Fewer than 3 seeds: no verdicts" in primary_md and primary_md.count(TOO_FEW) == 5
    assert "reproduced" not in primary_md


def test_report_writes_every_part(tmp_path):
    path = report(Study(synthetic()), paper.load(), tmp_path, "test", 60.0)
    text = path.read_text()
    for heading in (
        "## The primary family",
        "## What holds at which learning rate (exploratory)",
        "## Exploratory comparisons",
        "## Precision",
        "## Batch-matched control",
        "## Learning rate",
        "## Perplexity against time: A at each algorithm's F (exploratory)",
        "## Limitations",
    ):
        assert heading in text
    assert "picked on the same seeds" in text
    assert (tmp_path / "frontier.png").stat().st_size > 0 and (tmp_path / "drift.png").exists()
    assert "1.0 min" in text
    # per-run numbers: one row per run, the columns the verdicts are computed from
    runs = pd.read_csv(tmp_path / "runs.csv", keep_default_na=False)
    assert len(runs) == len(synthetic()) and list(runs.columns[: len(RUN_COLUMNS)]) == RUN_COLUMNS
    assert list(runs["eval_loss"].astype(float).map(math.exp)) == pytest.approx(
        list(runs["eval_perplexity"].astype(float))
    )
    # the frontier varies A at each algorithm's F and judges nothing
    frontier_md = text.split("## Perplexity against time")[1].split("## Limitations")[0]
    assert not any(w in frontier_md for w in ("reproduced", "opposite", "verdict", "trades"))


def test_a_run_with_a_schedule_is_read_and_leaves_the_base_a_alone(tmp_path):
    """algorithm.every as a schedule ([[0, 1], [4, 8]]) in the study's runs: read, never taken for
    the base A (an integer: 8 here), and its own configuration (it crashed the study: int(list))."""
    runs = synthetic() + [_run("fl_fsdp", s, 480.0, every=[[0, 1], [4, 8]], network="netns") for s in range(5)]
    st = Study(runs)
    assert st.every == 8
    assert len(st.select("fl_fsdp", every="[[0, 1], [4, 8]]", network="netns")) == 5
    assert report(st, paper.load(), tmp_path / "report", "test", None).exists()


def test_the_frontier_figure_draws_every_point_and_label_apart():
    """The committed study's frontier (5 A at F = 4 and at F = 2, FSDP and HSDP): no A label over
    another, and HSDP, at the time of FL+FSDP's A = 1, drawn as its own marker on top."""
    from analysis.science import frontier_figure

    table = pd.read_csv(ROOT / "experiments" / "science" / "frontier.csv", dtype={"A": str})
    fig = frontier_figure(table, "netns")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        boxes = [t.get_window_extent(renderer) for t in ax.texts]
        assert len(boxes) == 5
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :]), ax.get_title()
        baselines = {line.get_label(): line for line in ax.lines if line.get_label() in ("FSDP", "HSDP")}
        assert set(baselines) == {"FSDP", "HSDP"} and all(line.get_zorder() > 2 for line in baselines.values())
