"""fldp-cost as a user runs it (issue 30, item 16): the installed command's table fits a 100-column
terminal with units in its headers, and --csv and --json hold the numbers the table shows."""

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PAPER = ["topology=leonardo_512", "model=llama3_1_8b"]
ALGORITHMS = ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp")


def fldp_cost(tmp_path, *args, columns: int = 100) -> subprocess.CompletedProcess:
    command = Path(sys.executable).parent / "fldp-cost"
    assert command.exists(), f"fldp-cost is not installed beside {sys.executable}"
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([str(command), *args], capture_output=True, text=True, cwd=tmp_path, env=env)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cost")
    done = {
        fmt: fldp_cost(tmp, *PAPER, *flag) for fmt, flag in (("table", ()), ("csv", ("--csv",)), ("json", ("--json",)))
    }
    for fmt, proc in done.items():
        assert proc.returncode == 0, f"{fmt}: {proc.stderr[-2000:]}"
    assert not list(tmp.iterdir())  # a calculation writes no run directory
    return done


def _expected_cells(row: dict) -> list[list]:
    """What each of the four tables shows for an algorithm, from its unrounded row: mesh and B
    [Gbit/s], aggregations per step, the paper's step; seconds 'paper', seconds 'exact' and their
    ratio; bytes in GB; memory per rank in GB and whether it fits the A100's 64 GB."""

    def f(key):
        return float(row[key]) if row[key] not in ("", None) else None

    def phases(v):
        return [
            f(f"{v}_shard_s"),
            f(f"{v}_replicate_s"),
            f(f"{v}_federation_s") + f(f"{v}_broadcast_s"),
            f(f"{v}_total_s"),
        ]

    return [
        [
            row["mesh"],
            f("B_shard_gbit_s"),
            f("B_replicate_gbit_s"),
            f("B_federation_gbit_s"),
            f("aggregations_per_step"),
            f("measured_step_s"),
        ],
        phases("paper"),
        phases("exact") + [f("exact_over_paper")],
        [f(f"bytes_{d}_per_step") / 1e9 for d in ("shard", "replicate", "federation")],
        [
            (f("memory_parameters_bytes") + f("memory_optimizer_bytes")) / 1e9,
            f("memory_outer_bytes") / 1e9,
            (f("memory_root_unit_gathered_bytes") + f("memory_next_layer_gathered_bytes")) / 1e9,
            (f("memory_activations_bytes") + f("memory_loss_backward_bytes")) / 1e9,
            f("memory_peak_bytes") / 1e9,
            "yes" if row["memory_fits"] == "True" else "no",
        ],
    ]


def test_the_table_fits_100_columns_with_units_in_its_headers(outputs):
    text = outputs["table"].stdout
    widest = max(text.splitlines(), key=len)
    assert len(widest) <= 100, f"{len(widest)} columns: {widest!r}"
    for unit in ("[s]", "[Gbit/s]", "[GB]", "[x]"):
        assert unit in text
    assert "fed+bc" not in text and "repl " not in text  # no cryptic abbreviations


def test_csv_and_json_hold_the_numbers_the_table_shows(outputs):
    rows = {r["algorithm"]: r for r in csv.DictReader(io.StringIO(outputs["csv"].stdout))}
    as_json = {r["algorithm"]: r for r in json.loads(outputs["json"].stdout)}
    assert set(rows) == set(as_json) == set(ALGORITHMS)
    for algo in ALGORITHMS:
        for key, value in as_json[algo].items():  # the same numbers in both
            text = rows[algo][key]
            assert (
                text == str(value)
                if isinstance(value, (str, bool))
                else (text == "" if value is None else float(text) == value)
            ), (algo, key, text, value)
    lines = outputs["table"].stdout.splitlines()
    for algo in ALGORITHMS:
        shown = [line.split()[1:] for line in lines if line.split()[:1] == [algo]]
        expected = _expected_cells(rows[algo])
        assert len(shown) == len(expected), shown
        for cells, want in zip(shown, expected):
            assert len(cells) == len(want), (algo, cells, want)
            for cell, value in zip(cells, want):
                if isinstance(value, str):
                    assert cell == value
                elif value is None:
                    assert cell == "-"
                else:  # 4 significant digits
                    assert float(cell) == pytest.approx(value, rel=6e-4, abs=1e-12), (algo, cell, value)
    assert rows["fl_fsdp"]["measured_step_s"] == "1.45"  # the paper's Table 4, in the table's last mesh column


def test_csv_and_json_exclude_each_other(tmp_path):
    proc = fldp_cost(tmp_path, "--csv", "--json")
    assert proc.returncode == 2 and "--json and --csv" in proc.stderr
    assert not list(tmp_path.iterdir())  # refused before anything runs


def test_a_bad_setting_is_refused_naming_the_key_with_exit_2(tmp_path):
    """fldp-cost checks the config as fldp-train does (it used to end in a traceback, exit 1)."""
    proc = fldp_cost(tmp_path, *PAPER, "trainer.precision=fp64", "algorithm.every=0")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "trainer.precision='fp64': must be one of fp32, bf16" in proc.stderr and "algorithm.every" in proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())
