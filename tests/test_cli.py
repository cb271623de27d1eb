"""`python -m fldp.train` as a user runs it: every algorithm on every local topology, the default
command, and bad configs that must fail fast, naming the key, before any worker starts."""

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli, compose_cfg, read_rows

from fldp.records import CRITICAL_FIELDS, PHASES, STEP_FIELDS, TIME_FIELDS

FAST = ["wandb.mode=disabled", "trainer.eval_batches=1"]

# the documented default layouts (F, R, S)
LAYOUTS = {
    "local_2": {"fsdp": (1, 1, 2), "hsdp": (1, 2, 1), "fl_fsdp": (2, 1, 1), "fl_hsdp": (2, 1, 1)},
    "local_4": {"fsdp": (1, 1, 4), "hsdp": (1, 2, 2), "fl_fsdp": (2, 1, 2), "fl_hsdp": (2, 2, 1)},
    "local_8": {"fsdp": (1, 1, 8), "hsdp": (1, 2, 4), "fl_fsdp": (2, 1, 4), "fl_hsdp": (2, 2, 2)},
}
# the command line's path, which no algorithm changes, twice: the other precision and the
# meta-device init path (each algorithm's layout: the test above; what each computes:
# tests/test_golden.py; FSDP and HSDP from the command line: tests/test_paper_setting.py's smoke run
# and the tiny reproduction in CI)
RUNS = {
    "fl_fsdp": ("local_2", ["trainer.precision=bf16"]),
    "fl_hsdp": ("local_8", ["model.init_device=meta"]),
}


@pytest.mark.parametrize("topology,algorithm", [(t, a) for t in LAYOUTS for a in LAYOUTS[t]])
def test_every_algorithm_has_its_documented_layout_on_every_local_topology(topology, algorithm):
    cfg = compose_cfg(f"algorithm={algorithm}", f"topology={topology}")
    assert (cfg.mesh.federation, cfg.mesh.replicate, cfg.mesh.shard) == LAYOUTS[topology][algorithm]


@pytest.mark.parametrize("algorithm", RUNS)
def test_every_algorithm_runs_from_the_command_line(tmp_path, algorithm):
    topology, extra = RUNS[algorithm]
    out = cli(
        f"algorithm={algorithm}",
        f"topology={topology}",
        "trainer.steps=2",
        *FAST,
        *extra,
        f"hydra.run.dir={tmp_path}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["federation"], summary["replicate"], summary["shard"]) == LAYOUTS[topology][algorithm]
    assert summary["world_size"] == int(topology.split("_")[1])
    assert summary["steps"] == 2 and summary["eval_perplexity"] > 1
    assert summary["network"] == "loopback" and summary["network_link"] is None
    rows = read_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert len(read_rows(tmp_path, "eval")) == 1
    assert "| fwd " in out.stderr and " bwd " in out.stderr, out.stderr[-1000:]  # the progress bar's phases
    # the command that started it, as rank 0 of the forked workers recorded it
    assert summary["provenance"][
        "command"
    ] == f"python -m fldp.train algorithm={algorithm} topology={topology} " + " ".join(
        ["trainer.steps=2", *FAST, *extra, f"hydra.run.dir={tmp_path}"]
    )


def test_default_command_with_no_arguments(tmp_path):
    """Exactly `python -m fldp.train`: FL+HSDP on 8 local workers, records and an offline W&B run;
    aggregation only every A (8) steps, and each step's phase times consistent."""
    out = cli(cwd=tmp_path, env={"WANDB_MODE": "offline"})
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir,) = [p.parent for p in tmp_path.glob("outputs/*/*/summary.json")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["algorithm"] == "fl_hsdp" and summary["world_size"] == 8
    rows = read_rows(run_dir)
    assert len(rows) == summary["steps"] == 24
    assert [r["step"] for r in rows if r["time_aggregation"] > 0] == [8, 16, 24]
    assert [r["step"] for r in rows if r["aggregated"]] == [8, 16, 24]
    assert all(set(STEP_FIELDS) <= r.keys() for r in rows)
    # each time is the slowest rank's, so no phase exceeds the step
    assert all(r["time_step"] >= max(r[f] for f in TIME_FIELDS) for r in rows)
    # the slowest rank's own phases: they add up to its step, each at most that phase's slowest
    for r in rows:
        assert sum(r[f] for f in CRITICAL_FIELDS) == pytest.approx(r["time_step"], rel=1e-9, abs=1e-9)
        assert all(r[f"critical_{p}"] <= r[f"time_{p}"] for p in PHASES)
    (offline,) = run_dir.glob("wandb/offline-run-*")
    assert f"upload it with: wandb sync {offline}" in out.stdout + out.stderr, (out.stdout + out.stderr)[-2000:]


BAD = [
    (["mesh.federation=3"], "mesh.federation x mesh.replicate x mesh.shard"),
    (["algorithm=fsdp", "mesh.replicate=2", "mesh.shard=4"], "mesh.replicate=2"),
    (["algorithm=hsdp", "mesh.federation=2", "mesh.replicate=1"], "mesh.federation=2"),
    (["algorithm=fl_fsdp", "mesh.replicate=2", "mesh.shard=2"], "mesh.replicate=2"),
    (["algorithm.every=0"], "algorithm.every=0"),
    (["mesh.shard=0"], "mesh.shard=0"),
    (["algorithm.fedavg.mode=gossip"], "algorithm.fedavg.mode='gossip'"),
    (["trainer.precision=fp8"], "trainer.precision='fp8'"),
    (["dataset.data_files.train=/nonexistent/train.jsonl"], "dataset.data_files.train=/nonexistent"),
    (["dataset.tokenizer=/nonexistent/tokenizer"], "dataset.tokenizer=/nonexistent"),
    (["model.vocab_size=1000"], "model.vocab_size=1000"),
    # data that never repeats: more steps than one pass is refused with the numbers, not cycled
    (["dataset.max_passes=1", "trainer.steps=100000"], "dataset.max_passes=1: trainer.steps=100000"),
    # a corpus fldp-corpus builds, not built yet: the command that builds it, where the run reads it
    (["dataset=english_pd", "dataset.cache_dir=/nonexistent"], "fldp-corpus english_pd --out /nonexistent/corpora"),
    # an address of no interface here (TEST-NET-1): the workers could never meet there
    (["cluster.master_addr=192.0.2.1"], "cluster.master_addr='192.0.2.1': cannot listen there"),
]


@pytest.mark.parametrize("overrides,key", BAD, ids=[b[1].split("=")[0] for b in BAD])
def test_bad_config_fails_naming_the_key_before_any_worker(tmp_path, overrides, key):
    """No time limit asserted (machines are shared): that the schema's and the mesh's refusals do not
    wait for torch's import, most of a refusal's time, is the next test's."""
    out = cli(*overrides, f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert key in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "metrics.jsonl").exists(), "a worker started"


# refused by the schema or the mesh, which need nothing of torch
REFUSED_BEFORE_TORCH = [
    (["mesh.federation=3"], "mesh.federation x mesh.replicate x mesh.shard"),
    (["algorithm=fsdp", "mesh.replicate=2", "mesh.shard=4"], "mesh.replicate=2"),
    (["trainer.precision=fp8"], "trainer.precision='fp8'"),
    (["algorithm.every=0"], "algorithm.every=0"),
    (["mesh.shard=0"], "mesh.shard=0"),
]


@pytest.mark.parametrize("overrides,key", REFUSED_BEFORE_TORCH, ids=[" ".join(o) for o, _ in REFUSED_BEFORE_TORCH])
def test_a_config_the_schema_or_mesh_refuses_is_refused_before_torch_is_imported(tmp_path, overrides, key):
    """Importing torch took most of a refusal's 25-50 s on a loaded machine: `-X importtime` lists
    every module the process imported, and torch must not be one of them."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fldp.train", *overrides],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and f"fldp: config error: {key}" in out.stderr, out.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "omegaconf" in imported, "-X importtime listed nothing"
    assert not {m for m in imported if m.split(".")[0] in ("torch", "transformers", "datasets")}, sorted(
        m for m in imported if m.startswith("torch")
    )[:10]


REFUSED = [  # Hydra's own errors (composition, override grammar) and the schema's, single runs and sweeps
    (["trainer.step=4"], "trainer.step=4: no such setting (did you mean trainer.steps?)"),
    (["algorithm=bogus"], "Could not find 'algorithm/bogus'"),
    (["trainer.steps=[1"], "no viable alternative"),
    (["algorithm=fsdp,hsdp"], "Ambiguous value for argument 'algorithm=fsdp,hsdp'"),
    (["mesh.shard=0"], "mesh.shard=0: must be an integer >= 1"),
    (["-m", "algorithm=fsdp,bogus", "trainer.steps=1"], "Could not find 'algorithm/bogus'"),
    (["-m", "trainer.step=1,2"], "trainer.step=1: no such setting"),
]


@pytest.mark.parametrize("args,message", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_refused_command_exits_2_and_writes_nothing(tmp_path, args, message):
    """Before Hydra writes its outputs/.../.hydra/ and train.log, or a sweep's first point runs."""
    out = cli(*args, cwd=tmp_path, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]
    assert out.stderr.startswith("fldp: config error: ") and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert list(tmp_path.iterdir()) == [], "a refused command wrote " + ", ".join(map(str, tmp_path.rglob("*")))


def test_a_refused_run_leaves_an_existing_run_directory_as_it_was(tmp_path):
    """A run into a directory holding another run's records, refused, changes none of its files."""
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    files = {
        run_dir / "metrics.jsonl": '{"step": 1}\n',
        run_dir / "train.log": "the old run's log\n",
        run_dir / ".hydra" / "config.yaml": "the old run's config\n",
    }
    for path, text in files.items():
        path.write_text(text)
    for args in (["trainer.step=4"], ["trainer.steps=2"]):  # an unknown key; a run that is not a resume
        out = cli(*args, f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=60)
        assert out.returncode == 2, out.stderr[-2000:]
        assert {p: p.read_text() for p in files} == files
        assert sorted(p.name for p in run_dir.iterdir()) == [".hydra", "metrics.jsonl", "train.log"]
    assert "already holds a run's metrics.jsonl" in out.stderr


def test_a_fresh_run_beside_another_runs_checkpoints_is_refused(tmp_path):
    """Checkpoints without metrics.jsonl (the records deleted) are another run's too: a fresh run
    there would, once killed, resume from that run's newest checkpoint, of another timeline."""
    stale = tmp_path / "run" / "checkpoints" / "step_00000012"
    stale.mkdir(parents=True)
    (stale / "COMPLETE").write_text("")
    out = cli("trainer.steps=2", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=60)
    assert out.returncode == 2 and "checkpoints/" in out.stderr and "trainer.resume=auto" in out.stderr, out.stderr
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints"]


def test_help_imports_no_torch(tmp_path):
    """`--help` prints the groups without importing torch (seconds to import: --help took 5-9 s)."""
    code = (
        "import runpy, sys\nsys.argv = ['fldp-train', '--help']\ntry:\n"
        "    runpy.run_module('fldp.train', run_name='__main__')\nexcept SystemExit:\n    pass\n"
        "print('torch imported:', 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert "== Config groups" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.strip().endswith("torch imported: False"), out.stdout[-500:]


def test_version_prints_fldps_version_and_commit(tmp_path):
    """The installed command, as a user types it: fldp's version (the package's metadata) and the
    commit of this checkout (git's answer, '-dirty' with changes to tracked files), not Hydra's."""
    out = subprocess.run(
        [str(Path(sys.executable).parent / "fldp-train"), "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout.strip()
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == f"fldp {importlib.metadata.version('fldp')}, commit {head}{'-dirty' if dirty else ''}\n"
    assert "Hydra" not in out.stdout + out.stderr and list(tmp_path.iterdir()) == []
