"""`analysis/` on records of real short runs (4 algorithms x 2 seeds on local_2, each with an offline
W&B run, as users run them): every table cell against the records, seed aggregation, the figure files
and lines, the LaTeX, the ratios and findings, broken runs named and skipped, and the W&B sources."""

import json
import math
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import wandb_log
from conftest import ROOT, compose_cfg, read_rows, train_world
from omegaconf import OmegaConf

from analysis import claims, paper, render, tables
from analysis.discover import collect
from analysis.records import RecordError, load_run_dir
from analysis.report import build, main
from analysis.stats import TOO_FEW
from analysis.wandb_records import read_project
from fldp.records import PHASES

ALGOS = ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp")
SEEDS = (0, 1)
STEPS, EVERY = 4, 2
GROUP = "analysis_sweep"  # the sweep's W&B group


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A Hydra-multirun-like tree of real runs: <sweep>/<algorithm>_seed<N>/ with the records and
    the run's config in .hydra/config.yaml, as `python -m fldp.train -m` leaves them; W&B offline,
    the default (conftest's QUICK disables it: overridden here)."""
    import fldp.trainer  # noqa: F401  (imported once here, so the forked workers need not)

    root = tmp_path_factory.mktemp("sweep")
    for algo in ALGOS:
        for seed in SEEDS:
            extra = [f"algorithm.every={EVERY}"] if algo.startswith("fl_") else []
            train_run(root / f"{algo}_seed{seed}", f"algorithm={algo}", f"seed={seed}", *extra)
    return root


def train_run(run_dir, *overrides, wandb_mode="offline"):
    """A run as the trainer writes it, W&B offline (the default), its config where Hydra puts it."""
    cfg = compose_cfg(
        "topology=local_2",
        f"trainer.steps={STEPS}",
        "trainer.eval_batches=2",
        *overrides,
        f"wandb.mode={wandb_mode}",
        f"wandb.group={GROUP}",
    )
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    train_world(cfg, run_dir)


@pytest.fixture(scope="module")
def report(sweep, tmp_path_factory):
    runs, problems = collect([str(sweep)])
    assert problems == [] and len(runs) == len(ALGOS) * len(SEEDS)
    return build(runs, problems, tmp_path_factory.mktemp("report"), paper.load(), "test")


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def csv(report, name) -> pd.DataFrame:
    return pd.read_csv(report.out / name).set_index("label")


def test_table3_cells_are_the_records_across_seeds(sweep, report):
    t3 = csv(report, "table3.csv")
    md = (report.out / "table3.md").read_text()
    for algo in ALGOS:
        dirs = [sweep / f"{algo}_seed{s}" for s in SEEDS]
        per_seed = {
            "train_time_s": [sum(r["time_step"] for r in read_rows(d)) for d in dirs],
            "train_perplexity": [read_rows(d)[-1]["perplexity"] for d in dirs],
            "eval_perplexity": [summary(d)["eval_perplexity"] for d in dirs],
            "eval_time_s": [summary(d)["eval_time_s"] for d in dirs],
        }
        # each seed went to its own W&B run (offline, the default), and the seeds still pool
        assert len({summary(d)["wandb"]["id"] for d in dirs if summary(d)["wandb"]["mode"] == "offline"}) == len(SEEDS)
        row = t3.loc[tables.NAMES[algo]]
        assert row["seeds"] == len(SEEDS)
        for metric, values in per_seed.items():
            assert row[f"{metric}_mean"] == pytest.approx(statistics.mean(values), rel=1e-12)
            assert row[f"{metric}_std"] == pytest.approx(statistics.stdev(values), rel=1e-9)
        # the summary's own total agrees with the sum of the step times
        assert per_seed["train_time_s"] == pytest.approx([summary(d)["train_time_s"] for d in dirs])
        cells = [f"{statistics.mean(v):.2f} ± {statistics.stdev(v):.2f}" for v in per_seed.values()]
        assert f"| {tables.NAMES[algo]} | {len(SEEDS)} | {cells[1]} | {cells[0]} | {cells[2]} | {cells[3]} |" in md


def test_table4_is_the_per_step_phase_times(sweep, report):
    t4 = csv(report, "table4.csv")
    for algo in ALGOS:
        rows = {s: read_rows(sweep / f"{algo}_seed{s}") for s in SEEDS}
        row = t4.loc[tables.NAMES[algo]]
        for phase, key in [(p, f"time_{p}") for p in PHASES] + [("overall", "time_step")]:
            pooled = [r[key] for s in SEEDS for r in rows[s]]
            seed_means = [statistics.mean(r[key] for r in rows[s]) for s in SEEDS]
            assert row[f"{phase}_mean"] == pytest.approx(statistics.mean(pooled), rel=1e-12)
            assert row[f"{phase}_std"] == pytest.approx(statistics.stdev(pooled), rel=1e-9, abs=1e-15)
            assert row[f"{phase}_seed_std"] == pytest.approx(statistics.stdev(seed_means), rel=1e-9, abs=1e-15)
        if not algo.startswith("fl_"):
            assert row["aggregation_mean"] == 0 and row["aggregation_std"] == 0
    runs = pd.read_csv(report.out / "runs.csv")
    assert sorted(zip(runs["algorithm"], runs["seed"])) == sorted((a, s) for a in ALGOS for s in SEEDS)


def test_one_seed_has_no_spread(sweep, tmp_path):
    runs, _ = collect([str(sweep / "fsdp_seed0"), str(sweep / "hsdp_seed1")])
    rep = build(runs, [], tmp_path, paper.load(), "test")
    t3 = csv(rep, "table3.csv")
    assert list(t3["seeds"]) == [1, 1] and t3["train_time_s_std"].isna().all()
    assert "±" not in (tmp_path / "table3.md").read_text()


def test_a_resumed_seed_is_the_same_configuration(sweep, tmp_path):
    """Settings that control a run but not its mathematics (resume, checkpoints, progress, W&B, the
    byte meter, the init device) never split a configuration: FSDP keeps one row and stays in the
    ratios. A setting that does change it (the learning rate) still splits it."""

    def copy_with(name, **changes):
        tree = tmp_path / name
        shutil.copytree(sweep, tree)
        path = tree / "fsdp_seed1" / ".hydra" / "config.yaml"
        config = OmegaConf.load(path)
        for key, value in changes.items():
            OmegaConf.update(config, key.replace("__", "."), value)
        OmegaConf.save(config, path)
        runs, _ = collect([str(tree)])
        return build(runs, [], tmp_path / f"{name}_report", paper.load(), "test")

    resumed = copy_with(
        "resumed",
        trainer__resume="auto",
        trainer__checkpoint_every=2,
        trainer__progress=False,
        comm__measure=False,
        wandb__mode="offline",
        model__init_device="meta",
    )
    t3 = csv(resumed, "table3.csv")
    assert t3.loc["FSDP", "seeds"] == 2 and not any(label.startswith("FSDP (") for label in t3.index)
    assert "FSDP / FL+FSDP train time" in pd.read_csv(resumed.out / "ratios.csv")["ratio"].tolist()
    assert "left out of the ratios" not in (resumed.out / "report.md").read_text()

    assert "FedAvg mode" not in (resumed.out / "report.md").read_text()  # local_2's FL+HSDP has no replicas

    other_lr = csv(copy_with("other_lr", optimizer__lr=1e-3), "table3.csv")
    assert sorted(label for label in other_lr.index if label.startswith("FSDP")) == [
        "FSDP (optimizer.lr=0.0003)",
        "FSDP (optimizer.lr=0.001)",
    ]


def test_figure_files_and_one_line_per_algorithm(sweep, report):
    png, pdf = report.out / "figure2.png", report.out / "figure2.pdf"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(png) as im:
        im.verify()
    data = pdf.read_bytes()
    assert data.startswith(b"%PDF-") and b"%%EOF" in data[-1024:]

    ax = report.figure.axes[0]
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == [tables.NAMES[a] for a in ALGOS]
    assert ax.get_yscale() == "log"
    # each line: minutes = cumulative step time / 60, perplexity, both averaged over seeds per step
    for algo, line in zip(ALGOS, lines):
        rows = [read_rows(sweep / f"{algo}_seed{s}") for s in SEEDS]
        minutes = [statistics.mean(sum(r["time_step"] for r in rs[: k + 1]) / 60 for rs in rows) for k in range(STEPS)]
        ppl = [statistics.mean(rs[k]["perplexity"] for rs in rows) for k in range(STEPS)]
        assert list(line.get_xdata()) == pytest.approx(minutes)
        assert list(line.get_ydata()) == pytest.approx(ppl)


def _many_configurations(sweep, n: int) -> list:
    """n configurations of FL+FSDP with long labels: one real run each, its outer optimiser's settings
    changed (labels only, the records are the run's)."""
    import dataclasses

    (run,) = collect([str(sweep / "fl_fsdp_seed0")])[0]
    outer = {"name": "nesterov_momentum_with_a_long_name", "momentum": 0.9}
    return [
        dataclasses.replace(
            run,
            name=f"{run.name}#{i}",
            summary={
                **run.summary,
                "outer": {**outer, "lr": round(0.05 * (i + 1), 2), "note": "a long note " * (2 + i)},
            },
        )
        for i in range(n)
    ]


def test_figure_legend_below_the_axes_distinct_styles_plain_ticks(sweep, tmp_path):
    """12 configurations with long labels: the legend sits below the axes, inside the figure, the layout is
    applied (no warning) and keeps the y label, every line has its own colour, and log ticks read as
    plain numbers."""
    import warnings

    from matplotlib.colors import to_hex

    from analysis.figure import perplexity_figure, save

    runs = _many_configurations(sweep, 12)
    assert len(set(tables.labels(runs))) == 12 and max(map(len, tables.labels(runs))) > 150
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "constrained_layout not applied" is a UserWarning
        fig = perplexity_figure(runs)
        save(fig, tmp_path)
        fig.canvas.draw()  # the layout at the figure's own dpi, which the sizes below are read at
    renderer = fig.canvas.get_renderer()
    ax, (legend,) = fig.axes[0], fig.legends
    page = fig.bbox
    box = legend.get_window_extent(renderer)
    assert box.y1 <= ax.get_tightbbox(renderer).y0 + 1  # below the axes and their x label
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0
    ylabel = ax.yaxis.label
    assert ylabel.get_text() == "training perplexity" and ylabel.get_window_extent(renderer).x0 >= page.x0
    assert ax.get_window_extent(renderer).height > 0.3 * page.height  # the curves keep their room
    lines = ax.get_lines()
    assert len({to_hex(line.get_color()) for line in lines}) == 12
    ticks = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True) if t.get_text()]
    assert ticks and all(re.fullmatch(r"\d+(\.\d+)?[kM]?", t) for t in ticks), ticks


@pytest.mark.parametrize(
    "value,text",
    [(4100, "4100"), (4050.5, "4050"), (35, "35"), (0.5, "0.5"), (12345, "12.3k"), (41000, "41k"), (1.5e6, "1.5M")],
)
def test_tick_labels_are_plain_numbers(value, text):
    from analysis.figure import plain_number

    assert plain_number(value) == text


@pytest.fixture(scope="module")
def af_sweep(sweep, tmp_path_factory):
    """FL+FSDP on local_2 over A in {1, 2} and F in {1, 2} (F = 1: one group sharded over both ranks),
    2 seeds each: the sweep's A = 2, F = 2 runs and six more."""
    root = tmp_path_factory.mktemp("af")
    for seed in SEEDS:
        shutil.copytree(sweep / f"fl_fsdp_seed{seed}", root / f"A{EVERY}_F2_seed{seed}")
        for every, federation in ((1, 1), (1, 2), (EVERY, 1)):
            train_run(
                root / f"A{every}_F{federation}_seed{seed}",
                "algorithm=fl_fsdp",
                f"seed={seed}",
                f"algorithm.every={every}",
                f"mesh.federation={federation}",
                f"mesh.shard={2 // federation}",
                wandb_mode="disabled",  # the table reads the local records; W&B is the sweep's (~5 s a run)
            )
    return root


def test_a_sweep_over_a_and_f_has_its_table_and_heatmap(af_sweep, report, tmp_path):
    """Each A x F cell is the mean across seeds of each run's mean step time and its eval perplexity,
    computed here from metrics.jsonl and summary.json; report.md shows the grids and the heatmap."""
    runs, _ = collect([str(af_sweep)])
    rep = build(runs, [], tmp_path, paper.load(), "test")
    cells = pd.read_csv(tmp_path / "af.csv")
    assert set(cells["configuration"]) == {"FL+FSDP"} and len(cells) == 4
    text = (tmp_path / "report.md").read_text()
    for every in (1, EVERY):
        for federation in (1, 2):
            dirs = [af_sweep / f"A{every}_F{federation}_seed{s}" for s in SEEDS]
            step_time = statistics.mean(statistics.mean(r["time_step"] for r in read_rows(d)) for d in dirs)
            ppl = statistics.mean(summary(d)["eval_perplexity"] for d in dirs)
            assert {summary(d)["every"] for d in dirs} == {every} and {summary(d)["federation"] for d in dirs} == {
                federation
            }
            cell = cells[(cells["A"] == every) & (cells["F"] == federation)].iloc[0]
            assert cell["seeds"] == len(SEEDS)
            assert cell["step_time_s"] == pytest.approx(step_time, rel=1e-12)
            assert cell["eval_perplexity"] == pytest.approx(ppl, rel=1e-12)
            assert f"{ppl:.2f}" in text.split("## A x F")[1]
    assert "| A | F=1 | F=2 |" in text and "![A x F: step time and perplexity](af_1.png)" in text
    assert (tmp_path / "af_1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and rep.files
    # one (A, F) only: no such section
    assert "## A x F" not in (report.out / "report.md").read_text() and not (report.out / "af.csv").exists()


@pytest.mark.parametrize("stem,columns", [("table3", 6), ("table4", 7)])
def test_latex_tables_are_well_formed(report, stem, columns):
    tex = (report.out / f"{stem}.tex").read_text()
    for env in ("table", "tabular"):
        assert tex.count(f"\\begin{{{env}}}") == tex.count(f"\\end{{{env}}}") == 1
    spec = tex.split("\\begin{tabular}{", 1)[1].split("}", 1)[0]
    assert len(spec) == columns
    body = tex.split("\\toprule", 1)[1].split("\\bottomrule", 1)[0].replace("\\midrule", "")
    rows = [r for r in body.split("\\\\") if r.strip()]
    assert len(rows) == 1 + len(ALGOS)  # header + one row per algorithm
    for r in rows:
        assert r.replace("\\&", "").count("&") == columns - 1, r
    assert tex.count("{") == tex.count("}") and "±" not in tex


def test_latex_escapes_text():
    assert (
        render.latex_escape("FL+HSDP (fedavg_mode=all_replicas, 50%)") == r"FL+HSDP (fedavg\_mode=all\_replicas, 50\%)"
    )


def test_ratios_and_findings_follow_the_numbers(sweep, report):
    p = paper.load()
    ratios = pd.read_csv(report.out / "ratios.csv").set_index("ratio")
    for r in p["ratios"]:
        metric = r["metric"]
        num = [summary(sweep / f"{r['numerator']}_seed{s}") for s in SEEDS]
        den = [summary(sweep / f"{r['denominator']}_seed{s}") for s in SEEDS]
        if metric == "train_time_s":  # the records' sum, as the tables
            num = [{metric: sum(x["time_step"] for x in read_rows(sweep / f"{r['numerator']}_seed{s}"))} for s in SEEDS]
            den = [
                {metric: sum(x["time_step"] for x in read_rows(sweep / f"{r['denominator']}_seed{s}"))} for s in SEEDS
            ]
        per_seed = [a[metric] / b[metric] for a, b in zip(num, den)]
        logs = [math.log(x) for x in per_seed]  # paired: geometric mean, t interval on the mean log (df 1)
        half = 12.7062047 * statistics.stdev(logs) / math.sqrt(len(logs))
        row = ratios.loc[r["name"]]
        assert row["runs_ratio"] == pytest.approx(math.exp(statistics.mean(logs)))
        assert row["runs_high"] == pytest.approx(math.exp(statistics.mean(logs) + half), rel=1e-4)
        assert row["paper_quoted"] == r["quoted"] and row["seeds"] == len(SEEDS)
    assert ratios.loc["FSDP / FL+FSDP train time", "paper_table3"] == pytest.approx(770.54 / 95.87)
    assert "same_side_of_1" not in ratios.columns  # no side read off a mean

    found = pd.read_csv(report.out / "findings.csv", keep_default_na=False)
    stat = found[found["family"] != "records check"]
    assert (stat["paper"].astype(float) > 1).all(), "a finding's definition does not match the paper"
    assert list(stat.loc[stat["family"] == "primary", "comparison"]) == [
        "HSDP / FL+HSDP",
        "FSDP / FL+HSDP",
        "FSDP / FL+FSDP",
        "FL+FSDP / FL+HSDP",
        "HSDP / FSDP",
    ]
    # 2 seeds: no direction or size verdict, however the two seeds fall
    assert (stat["direction"] == TOO_FEW).all() and (stat["size"] == "n/a").all()
    agg = found.set_index("finding").iloc[-1]
    assert agg["direction"] == "holds in every run", agg["runs"]
    text = (report.out / "report.md").read_text()
    assert "## Findings of the paper: reproduced or not" in text and "identical in every run" in text
    assert "every seed" not in text and "same side of 1" not in text.lower()


def _values(ppl: dict, seeds) -> pd.DataFrame:
    """claims' long frame: every metric equal across algorithms but the eval perplexity."""
    return pd.DataFrame(
        [
            {
                "algorithm": a,
                "seed": s,
                "eval_perplexity": v[i],
                "train_time_s": 1.0,
                "step_time_s": 1.0,
                "eval_time_s": 1.0,
            }
            for a, v in ppl.items()
            for i, s in enumerate(seeds)
        ]
    )


def test_findings_are_paired_intervals_not_means_or_unanimous_seeds():
    p = paper.load()
    base = {"fsdp": [500.0, 400.0, 600.0], "hsdp": [500.0, 400.0, 600.0], "fl_hsdp": [300.0, 240.0, 360.0]}
    # 2 seeds, both far on the paper's side (FL+FSDP 0.8x FSDP): once "reproduced", now no verdict
    two = claims.findings(p, _values({**base, "fl_fsdp": [400.0, 320.0, 480.0]}, [0, 1, 2]).query("seed < 2"), [])
    row = two.set_index("finding").loc["FL+FSDP reaches a lower eval perplexity than FSDP"]
    assert row["direction"] == TOO_FEW and row["seeds"] == 2
    # 3 seeds whose mean ratio is above 1 but whose interval holds 1: no side, inconclusive
    three = claims.findings(p, _values({**base, "fl_fsdp": [400.0, 440.0, 630.0]}, [0, 1, 2]), [])
    row = three.set_index("finding").loc["FL+FSDP reaches a lower eval perplexity than FSDP"]
    assert row["ratio"] > 1 and row["lo"] < 1 < row["hi"] and row["direction"] == "inconclusive"
    # the primary family is Holm-corrected; FL+HSDP 0.6x in every seed is reproduced, its size refuted
    primary = three[three["family"] == "primary"].set_index("finding")
    assert (primary["level"] > 0.95).all()
    assert primary.loc["FL+HSDP reaches a lower eval perplexity than HSDP", "direction"] == "reproduced"
    assert (
        primary.loc["FL+HSDP reaches a lower eval perplexity than HSDP", "size"] == "effect size refuted at this scale"
    )
    assert (three.loc[three["family"] == "exploratory", "level"] == 0.95).all()


def test_runs_of_two_commits_are_reported_together_only_when_asked(sweep, tmp_path, capsys):
    """Each summary records the commit and the provenance of its run; a report over runs of two
    commits writes nothing and exits 2 naming both, unless --allow-mixed."""
    import torch

    from analysis.report import main as report_main

    first = summary(sweep / "fsdp_seed0")
    assert first["commit"] and first["provenance"]["versions"]["torch"] == torch.__version__
    assert first["provenance"]["host"] and first["provenance"]["python"]
    tree = tmp_path / "runs"
    shutil.copytree(sweep, tree)
    changed = tree / "hsdp_seed1" / "summary.json"
    changed.write_text(json.dumps({**summary(tree / "hsdp_seed1"), "commit": "0" * 40}))
    with pytest.raises(SystemExit) as refused:
        report_main([str(tree), "--out", str(tmp_path / "mixed")])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "from 2 commits" in err and "0" * 40 + " (1 runs" in err, err
    assert f"{first['commit']} ({len(ALGOS) * len(SEEDS) - 1} runs" in err, err
    assert not (tmp_path / "mixed").exists()
    assert report_main([str(tree), "--out", str(tmp_path / "mixed"), "--allow-mixed"]) == 0
    runs = pd.read_csv(tmp_path / "mixed" / "runs.csv")  # each row says which commit made it
    assert sorted(runs["commit"].unique()) == sorted({first["commit"], "0" * 40})


def test_broken_runs_are_named_and_skipped(sweep, tmp_path, capsys):
    tree = tmp_path / "runs"
    for algo in ALGOS:
        shutil.copytree(sweep / f"{algo}_seed0", tree / f"{algo}_seed0")
    empty = tree / "empty_metrics"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    crashed = tree / "crashed_midway"  # records up to step 2, then the run died: no summary
    crashed.mkdir()
    (crashed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in read_rows(sweep / "fsdp_seed1")[:2]))
    never = tree / "never_started"  # Hydra made the job folder; the run failed before step 1
    (never / ".hydra").mkdir(parents=True)
    shutil.copy(sweep / "fsdp_seed1" / ".hydra" / "config.yaml", never / ".hydra")
    torn = tree / "torn_line"
    shutil.copytree(sweep / "hsdp_seed1", torn)
    with open(torn / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 8.3')

    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "analysis.report", str(tree), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    expected = {
        empty: "metrics.jsonl is empty",
        crashed: "no summary.json: the run did not finish",
        never: "no metrics.jsonl",
        torn: "metrics.jsonl line 6 is not valid JSON",
    }
    for run, why in expected.items():
        assert f"skipped {run}: {why}" in proc.stderr, proc.stderr
        assert f"- {run}: {why}" in (out / "report.md").read_text()
    assert f"by `python -m analysis.report {tree} --out {out}`." in (out / "report.md").read_text()
    t3 = pd.read_csv(out / "table3.csv")
    assert list(t3["label"]) == [tables.NAMES[a] for a in ALGOS] and (t3["seeds"] == 1).all()

    assert main([str(tree), "--out", str(out), "--strict"]) == 1  # in-process: the CLI once is enough
    assert main([str(empty), "--out", str(tmp_path / "none")]) == 1
    assert "no usable runs" in capsys.readouterr().err and not (tmp_path / "none").exists()


def test_record_checks_name_the_run(sweep, tmp_path):
    run = tmp_path / "twice"
    shutil.copytree(sweep / "fsdp_seed0", run)
    (run / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text() * 2)  # a rerun appended
    with pytest.raises(RecordError, match=f"{run}: step 1 is recorded twice"):
        load_run_dir(run)
    short = tmp_path / "short"
    shutil.copytree(sweep / "fsdp_seed0", short)
    lines = (short / "metrics.jsonl").read_text().splitlines()
    (short / "metrics.jsonl").write_text("\n".join(lines[1:]) + "\n")
    with pytest.raises(RecordError, match=f"{short}: summary says {STEPS} steps"):
        load_run_dir(short)


def test_an_offline_wandb_folder_stands_for_its_run_directory(sweep, tmp_path):
    run_dir = sweep / "fl_fsdp_seed0"
    (folder,) = run_dir.glob("wandb/offline-run-*")
    # the run directory itself is read from its JSONL, never from its wandb/ folder
    runs, _ = collect([str(run_dir)])
    assert [(r.source, r.name) for r in runs] == [("jsonl", str(run_dir))]
    for named in (folder, run_dir / "wandb"):  # the folder, or a tree holding only it
        runs, problems = collect([str(named)])
        assert [(r.source, r.name) for r in runs] == [("jsonl", str(run_dir))] and not problems
    # outside a run directory there are no records to stand for: refused, saying what to do
    alone = tmp_path / "wandb" / folder.name
    shutil.copytree(folder, alone)
    runs, problems = collect([str(alone)])
    assert not runs and len(problems) == 1 and "wandb sync" in problems[0] and "wandb:ENTITY/PROJECT" in problems[0]


class Remote:
    """One run as W&B's public API hands it out (wandb.apis.public.Run), made of what `wandb sync` would
    send it: the run's offline log (tests/wandb_log.py). Its labels and config, one history row per step
    (`_step`, `_runtime`, `_timestamp` and the logged keys, a step's eval merged into its row), and the
    summary W&B's updates leave (W&B's keys, the last `train/*`, `eval/*` values, the fields
    Recorder.finish passes), in W&B's own HTTPSummary: nested values are not dicts, `_wandb` is hidden
    from keys(). `changes` make decoys: another group, or another commit."""

    def __init__(
        self,
        run_dir: Path,
        state: str | None = None,
        group: str | None = None,
        commit: str | None = None,
        id_suffix: str = "",
    ):
        from types import SimpleNamespace

        from wandb.apis.public.summary import HTTPSummary

        (log,) = run_dir.glob("wandb/*-run-*/run-*.wandb")
        records = wandb_log.records(log)
        kinds = lambda kind: [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]
        (run,) = kinds("run")
        self.id, self.name = run.run_id + id_suffix, run.display_name
        self.group, self.job_type, self.tags = group or run.run_group, run.job_type, list(run.tags)
        self.config = {k: v for k, v in _items(run.config.update).items() if not k.startswith("_wandb")}
        for update in kinds("config"):
            self.config.update(_items(update.update))
        self._history = [_items(h.item) for h in kinds("history")]
        merged = {}
        for update in kinds("summary"):
            for item in update.update:
                *path, key = list(item.nested_key) or [item.key]
                node = merged
                for part in path:
                    node = node.setdefault(part, {})
                node[key] = json.loads(item.value_json)
        if commit:
            self.config["commit"] = merged["commit"] = commit
        self.state = state or ("finished" if [e.exit_code for e in kinds("exit")] == [0] else "crashed")
        self.summary = HTTPSummary(SimpleNamespace(dir=str(run_dir)), None, summary=merged)

    def scan_history(self):
        yield from (dict(row) for row in self._history)


def _items(items) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def _field(remote: Remote, key: str):
    if key.startswith("config."):
        value = remote.config
        for part in key.split(".")[1:]:
            value = value.get(part) if isinstance(value, dict) else None
        return value
    return {
        "group": remote.group,
        "jobType": remote.job_type,
        "tags": remote.tags,
        "state": remote.state,
        "display_name": remote.name,
    }[key]  # an unknown field fails the test


def _matches(remote: Remote, query: dict) -> bool:
    """W&B's run filters (MongoDB syntax, as its docs give them): a list field matches when one of its
    elements does."""
    for key, condition in query.items():
        if key in ("$and", "$or"):
            found = [_matches(remote, q) for q in condition]
            if not (all(found) if key == "$and" else any(found)):
                return False
            continue
        value = _field(remote, key)
        values = value if isinstance(value, list) else [value]
        if not isinstance(condition, dict):
            condition = {"$eq": condition}
        for op, arg in condition.items():
            ok = {
                "$eq": lambda: arg in values,
                "$in": lambda: any(v in arg for v in values),
                "$regex": lambda: any(isinstance(v, str) and re.search(arg, v) for v in values),
            }[op]()
            if not ok:
                return False
    return True


@pytest.fixture
def wandb_project(monkeypatch):
    """`wandb.Api()` answering for the project team/fldp with the given Remotes, filters applied."""
    import wandb

    project = {"runs": [], "queries": []}

    class Api:
        def runs(self, path, filters=None, **_):
            assert path == "team/fldp"
            project["queries"].append(filters)
            return [r for r in project["runs"] if _matches(r, filters or {})]

    monkeypatch.setattr(wandb, "Api", Api)
    return project


def test_online_project_through_the_public_api(sweep, wandb_project):
    """The API itself needs network: a stand-in with its shape checks what is made of it. Runs that
    W&B summarises with its own keys (`_timestamp`, the last `train/*`) still pool by seed."""
    wandb_project["runs"] += [Remote(sweep / f"fl_fsdp_seed{s}") for s in SEEDS]
    wandb_project["runs"].append(Remote(sweep / "fsdp_seed0", state="crashed"))
    runs, problems = read_project("team/fldp")
    assert [r.name for r in runs] == [
        f"wandb:team/fldp/{summary(sweep / f'fl_fsdp_seed{s}')['wandb']['id']} "
        f"({summary(sweep / f'fl_fsdp_seed{s}')['wandb']['name']})"
        for s in SEEDS
    ]
    assert list(runs[0].steps["time_step"]) == [r["time_step"] for r in read_rows(sweep / "fl_fsdp_seed0")]
    assert {"_timestamp", "_runtime", "_step", "train/perplexity", "eval/perplexity"} <= set(runs[0].summary)
    assert runs[0].summary["outer"] == summary(sweep / "fl_fsdp_seed0")["outer"]  # a dict, as summary.json's
    assert tables.labels(runs) == ["FL+FSDP", "FL+FSDP"]
    crashed = summary(sweep / "fsdp_seed0")["wandb"]
    assert problems == [
        f"wandb:team/fldp/{crashed['id']} ({crashed['name']}): no final W&B summary: the run "
        f"did not finish (crashed or still running) after step {STEPS}"
    ]


def test_a_wandb_project_alone_regenerates_the_tables_and_figure(sweep, report, wandb_project, tmp_path):
    """A user with only the W&B project: `fldp-report wandb:ENTITY/PROJECT --group G --commit C` gives the
    tables and figure the run directories give; another sweep's runs and another commit's are not read."""
    from analysis.report import main as report_main

    dirs = sorted(sweep.iterdir())
    commit = summary(dirs[0])["commit"]
    other_commit = "0" * 40
    wandb_project["runs"] += [Remote(d) for d in dirs]
    wandb_project["runs"] += [
        Remote(sweep / "fsdp_seed0", group="another_sweep", id_suffix="x"),
        Remote(sweep / "hsdp_seed0", id_suffix="y", commit=other_commit),
    ]
    out = tmp_path / "from_wandb"
    assert report_main(["wandb:team/fldp", "--group", GROUP, "--commit", commit[:7], "--out", str(out)]) == 0
    assert wandb_project["queries"][-1] == {"$and": [{"group": GROUP}, {"config.commit": {"$regex": f"^{commit[:7]}"}}]}
    for name in ("table3.csv", "table4.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(out / name), pd.read_csv(report.out / name))
    assert (out / "figure2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Generated" in (out / "report.md").read_text()

    # by tag and job type: the FL+FSDP runs, both seeds
    only = tmp_path / "fl_fsdp"
    assert (
        report_main(
            [
                "wandb:team/fldp",
                "--group",
                GROUP,
                "--tag",
                "topology=local_2",
                "--tag",
                f"A={EVERY}",
                "--job-type",
                "fl_fsdp",
                "--out",
                str(only),
            ]
        )
        == 0
    )
    t3 = pd.read_csv(only / "table3.csv")
    assert list(t3["label"]) == ["FL+FSDP"] and list(t3["seeds"]) == [len(SEEDS)]
    # without the commit filter the other commit's run is read, and refused with the rest
    with pytest.raises(SystemExit) as mixed:
        report_main(["wandb:team/fldp", "--group", GROUP, "--out", str(tmp_path / "mixed")])
    assert mixed.value.code == 2


def test_wandb_filters_without_a_wandb_project_are_refused(sweep, tmp_path):
    proc = subprocess.run(
        [_installed("fldp-report"), str(sweep), "--group", GROUP, "--out", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "wandb:ENTITY/PROJECT" in proc.stderr, proc.stderr
    assert not (tmp_path / "r").exists()


def _installed(command: str) -> str:
    """A console script of this environment's fldp (pip install -e .), as a user runs it."""
    path = Path(sys.executable).parent / command
    assert path.exists(), f"{command} is not installed in {path.parent}"
    return str(path)


def test_report_names_the_command_that_made_it(sweep, tmp_path):
    """report.md says `fldp-report ...` when fldp-report made it (from a wheel `python -m
    analysis.report` would fail), and `python -m analysis.report ...` when that did."""
    out = tmp_path / "installed"
    proc = subprocess.run(
        [_installed("fldp-report"), str(sweep), "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert f"by `fldp-report {sweep} --out {out}`." in (out / "report.md").read_text()
    assert "constrained_layout not applied" not in proc.stderr, proc.stderr


def test_report_says_which_fedavg_mode_ran(sweep, tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(sweep / "fl_hsdp_seed0", tree / "fl_hsdp_seed0")
    path = tree / "fl_hsdp_seed0" / "summary.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "fedavg_mode": "all_replicas"}))
    runs, _ = collect([str(tree)])
    text = (build(runs, [], tmp_path / "report", paper.load(), "test").out / "report.md").read_text()
    assert "FedAvg mode of the runs with replicas: all_replicas (fl_hsdp)." in text


def test_outer_optimiser_settings_label_configurations(sweep, tmp_path):
    """A sweep over algorithm.outer.lr: one row per value, labelled once by the summary's outer.lr."""
    for lr in (0.5, 0.7):
        run = tmp_path / f"fl_fsdp_lr{lr}"
        shutil.copytree(sweep / "fl_fsdp_seed0", run)
        summary_path = run / "summary.json"
        s = json.loads(summary_path.read_text())
        summary_path.write_text(json.dumps({**s, "outer": {**s["outer"], "lr": lr}}))
        config = OmegaConf.load(run / ".hydra" / "config.yaml")
        OmegaConf.update(config, "algorithm.outer.lr", lr)
        OmegaConf.save(config, run / ".hydra" / "config.yaml")
    runs, _ = collect([str(tmp_path)])
    assert sorted(tables.labels(runs)) == ["FL+FSDP (outer.lr=0.5)", "FL+FSDP (outer.lr=0.7)"]


def test_periodic_aggregation_reads_a_schedule():
    """The finding's expected steps follow a schedule as the trainer runs it: [[0,2],[3,3]] over 6
    steps aggregates at 2, 5 (3 steps after 2) and 6 (the last), by hand."""
    from analysis.claims import periodic_aggregation
    from analysis.records import Run

    def run(aggregated):
        steps = pd.DataFrame(
            {
                "step": range(1, 7),
                "aggregated": [s in aggregated for s in range(1, 7)],
                "time_aggregation": [0.5 if s in aggregated else 0.0 for s in range(1, 7)],
            }
        )
        return Run("scheduled", {"every": [[0, 2], [3, 3]]}, steps)

    assert periodic_aggregation([run({2, 5, 6})])[0] == "holds in every run"
    assert periodic_aggregation([run({2, 6})])[0] == "fails"  # counted from the phase's start
