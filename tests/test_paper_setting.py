"""The headline command is the paper's run: `topology=leonardo_512` alone composes the paper's setting
(paper.md, Section 5), equal to `+experiment=paper_512`; overrides still win, and the dry run says
plainly when a run is not the paper's."""

import os
import subprocess
import sys

import pytest
from conftest import compose_cfg
from omegaconf import OmegaConf

NO_SLURM_ENV = {"PATH": "/nonexistent"}  # a dry run needs no sbatch (Python is started by its full path)
ALGORITHMS = ("fsdp", "hsdp", "fl_fsdp", "fl_hsdp")


def resolved(cfg) -> dict:
    out = OmegaConf.to_container(cfg, resolve=True)
    out.pop("wandb")  # the experiment names its W&B group; nothing else may differ
    return out


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_topology_alone_composes_the_paper_experiment(algorithm):
    cfg = compose_cfg(f"algorithm={algorithm}", "topology=leonardo_512")
    assert resolved(cfg) == resolved(compose_cfg("+experiment=paper_512", f"algorithm={algorithm}"))
    assert (cfg.model.name, cfg.dataset.name, cfg.trainer.precision, cfg.trainer.batch_size) == (
        "llama3_1_8b",
        "clean_mc4_it",
        "bf16",
        2,
    )
    assert cfg.trainer.steps is None and cfg.dataset.train_blocks // (512 * 2) == 64  # one pass: 64 steps
    assert (
        cfg.optimizer.name,
        cfg.optimizer.lr,
        list(cfg.optimizer.betas),
        cfg.optimizer.weight_decay,
        cfg.optimizer.warmup,
        cfg.seed,
    ) == ("adamw", 3e-4, [0.9, 0.95], 0.1, 0.1, 42)
    assert cfg.fsdp.reshard_root_after_forward is False  # FSDP1 FULL_SHARD's root, as the authors ran
    assert cfg.cluster.name == "leonardo"
    if algorithm.startswith("fl_"):
        assert cfg.algorithm.every == 8
    if algorithm == "fl_hsdp":  # the mode that produced Table 4's times (the authors' code)
        assert cfg.algorithm.fedavg.mode == "all_replicas"


def test_overrides_still_win_and_local_defaults_are_untouched():
    cfg = compose_cfg(
        "topology=leonardo_512",
        "model=tiny_llama",
        "cluster=local",
        "trainer.steps=3",
        "algorithm.fedavg.mode=leader_broadcast",
    )
    assert (cfg.model.name, cfg.cluster.name, cfg.trainer.steps, cfg.algorithm.fedavg.mode) == (
        "tiny_llama",
        "local",
        3,
        "leader_broadcast",
    )
    default = compose_cfg()
    assert (default.model.name, default.dataset.name, default.trainer.steps, default.algorithm.fedavg.mode) == (
        "tiny_llama",
        "diodati_1649",
        24,
        "leader_broadcast",
    )


def dry_run(tmp_path, *overrides):
    out = subprocess.run(
        [sys.executable, "-m", "fldp.train", *overrides, "cluster.dry_run=true", f"hydra.run.dir={tmp_path}"],
        cwd=tmp_path.parent,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **NO_SLURM_ENV},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_headline_dry_run_is_the_paper_and_a_smoke_test_says_it_is_not(tmp_path):
    text = dry_run(tmp_path / "paper", "algorithm=fl_hsdp", "topology=leonardo_512")
    assert "mesh: fl_hsdp 16x8x4" in text and "all_replicas" in text
    assert "run: model llama3_1_8b, dataset clean_mc4_it, bf16, batch 2 per rank, 64 steps" in text
    assert "setting: the paper's (paper.md, Section 5)" in text
    # operational keys (resume, checkpoints, the meter) do not make it another experiment
    same = dry_run(
        tmp_path / "resumed",
        "algorithm=fl_hsdp",
        "topology=leonardo_512",
        "trainer.resume=auto",
        "trainer.checkpoint_every=8",
        "comm.measure=false",
    )
    assert "setting: the paper's" in same
    smoke = dry_run(
        tmp_path / "smoke", "algorithm=fsdp", "topology=leonardo_512", "model=tiny_llama", "optimizer.lr=0.001"
    )
    line = next(x for x in smoke.splitlines() if x.startswith("setting:"))
    assert (
        line == "setting: NOT the paper's; differs in model='tiny_llama' (paper: 'llama3_1_8b'); "
        "optimizer.lr=0.001 (paper: 0.0003)"
    )
