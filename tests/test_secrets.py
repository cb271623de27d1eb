"""Secrets given through the environment (a W&B API key, a SLURM account) never reach the run
directory or a dry run's output; W&B online without a key fails at once instead of prompting."""

import os
import subprocess
import sys

from conftest import cli

KEY = "fake0wandb0key0" + "7" * 25  # the shape of a W&B key: 40 characters
ACCOUNT = "planted-secret-account-93"


def found_in(root, *secrets) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits += [f"{path}: {s}" for s in secrets if s.encode() in data]
    return hits


def test_planted_secrets_appear_nowhere_in_a_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    # a value the config reads from the environment (dataset.cache_dir from FLDP_CACHE) stands for any
    # such secret: W&B gets the whole config, so this is where it would leak
    out = cli(
        "algorithm=fl_fsdp",
        "topology=local_2",
        "trainer.steps=2",
        "trainer.eval_batches=1",
        "wandb.mode=offline",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        env={
            "WANDB_API_KEY": KEY,
            "SBATCH_ACCOUNT": ACCOUNT,
            "WANDB_MODE": "offline",
            "FLDP_CACHE": str(tmp_path / ACCOUNT),
        },
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert list(run_dir.glob("wandb/offline-run-*")), "no offline W&B run to search"
    assert found_in(run_dir, KEY, ACCOUNT) == []
    assert KEY not in out.stdout + out.stderr and ACCOUNT not in out.stdout + out.stderr


def test_a_dry_run_never_prints_the_account(tmp_path):
    env = {**os.environ, "PATH": "/nonexistent", "SBATCH_ACCOUNT": ACCOUNT, "WANDB_API_KEY": KEY}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fldp.train",
            "algorithm=fl_hsdp",
            "topology=leonardo_512",
            "cluster.dry_run=true",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "account (from SBATCH_ACCOUNT)" in out.stdout
    assert ACCOUNT not in out.stdout + out.stderr and KEY not in out.stdout + out.stderr
    assert found_in(tmp_path, KEY, ACCOUNT) == []


def test_wandb_online_without_a_key_fails_at_once(tmp_path):
    """At once: before any worker, and without asking for a key (no standard input: a prompt would
    wait until the time limit)."""
    env = {"HOME": str(tmp_path), "WANDB_API_KEY": "", "WANDB_MODE": "online"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fldp.train",
            "trainer.steps=1",
            "wandb.mode=online",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env={**{k: v for k, v in os.environ.items() if k != "WANDB_API_KEY"}, **env},
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "wandb.mode=online: no W&B API key" in out.stderr
    assert "local workers" not in out.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()
