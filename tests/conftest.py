"""Shared helpers: compose the real Hydra configs, run real worker processes over gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import fldp  # noqa: F401  (registers the fldp_asset resolver)
from fldp import validation
from fldp.data import prepare
from fldp.launch import run_local
from fldp.mesh import ConfigError, MeshShape
from fldp.model import import_forward

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Everything the tests load is on disk: never wait on a hub that a closed network may not refuse.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# No test may hang the suite: past its limit it fails, saying where it was stuck. The slowest test
# takes ~3 min here; @pytest.mark.timeout(N) sets another limit for one test.
TEST_LIMIT_S = float(os.environ.get("FLDP_TEST_LIMIT_S", 600))

# Small, quick runs: the tests are about equivalences, not about learning.
QUICK = ["wandb.mode=disabled", "trainer.progress=false", "trainer.eval_batches=1"]

# emulated nodes (fldp/netns.py) need root and iproute2: their tests are skipped without them, unless
# FLDP_REQUIRE_NETNS=1 (set by CI) makes that an error
try:
    validation.missing_tools("netns tests")
    NETNS_MISSING = None
except ConfigError as e:
    NETNS_MISSING = str(e)
if os.environ.get("FLDP_REQUIRE_NETNS") == "1" and NETNS_MISSING:
    raise RuntimeError(f"FLDP_REQUIRE_NETNS=1 but {NETNS_MISSING}")
needs_netns = pytest.mark.skipif(NETNS_MISSING is not None, reason=NETNS_MISSING or "")


def compose_cfg(*overrides: str):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[*QUICK, *overrides])


def cluster(timeout_s: float = 120):
    return OmegaConf.create(
        {"master_addr": "127.0.0.1", "master_port": None, "timeout_s": timeout_s, "threads_per_worker": 1}
    )


def run_world(fn, world: int, *args, timeout_s: float = 120) -> None:
    """fn(*args, device) on `world` forked ranks with an initialised gloo process group."""
    import_forward()  # as fldp.train before it forks
    run_local(fn, args, world, "cpu", cluster(timeout_s))


def _train_rank(cfg, run_dir, blocks, on_step, device):
    from fldp.trainer import train

    train(cfg, run_dir, blocks, device, on_step=on_step)


def train_world(cfg, run_dir: Path, on_step=None) -> list[dict]:
    """The real trainer on real processes; returns the training rows of metrics.jsonl."""
    blocks = prepare(cfg.dataset)
    shape = MeshShape(cfg.mesh.federation, cfg.mesh.replicate, cfg.mesh.shard)
    run_world(_train_rank, shape.world, cfg, str(run_dir), blocks, on_step)
    return read_rows(run_dir)


def read_rows(run_dir: Path, split: str | None = None) -> list[dict]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("split") == split]


class Snapshot:
    """on_step callback: at the chosen steps, the shard-0 rank of every (federation, replicate)
    replica saves that replica's full parameters to `out/f{F}_r{R}_step{N}.pt`."""

    def __init__(self, out: Path, steps, cfg):
        self.out, self.steps = Path(out), set(steps)
        self.out.mkdir(parents=True, exist_ok=True)
        self.shape = MeshShape(cfg.mesh.federation, cfg.mesh.replicate, cfg.mesh.shard)

    def __call__(self, step, state, aggregated):
        if step not in self.steps:
            return
        full = {n: p.full_tensor().detach().clone() for n, p in state.model.named_parameters()}  # group collective
        f, r, s = self.shape.coords(dist.get_rank())
        if s == 0:
            torch.save(full, self.out / f"f{f}_r{r}_step{step}.pt")

    def load(self, f: int, r: int, step: int) -> dict:
        return torch.load(self.out / f"f{f}_r{r}_step{step}.pt")


def identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def cli(*args: str, cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m fldp.train ARGS` as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "fldp.train", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def pytest_collection_modifyitems(items):
    """pytest-timeout, method=signal: SIGALRM at the test's limit fails it in its (main) thread,
    printing every thread's stack, so a blocked wait, a subprocess or local workers are interrupted
    and cleaned up by their own `finally`s, and the other tests run (a timer is not inherited by
    forked workers). The limit: @pytest.mark.timeout(N) on the test, else TEST_LIMIT_S."""
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_LIMIT_S, method="signal"))
    # The SLURM tests first: they mostly wait on the scheduler, so one pytest-xdist worker takes them
    # (a whole file, in order) while the other computes (pyproject.toml: --no-loadscope-reorder)
    items.sort(key=lambda item: item.path.name != "test_slurm.py")


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory) -> Path:
    """The default dataset's token cache, made as a user makes it before submitting to SLURM:
    `python -m fldp.data`, with FLDP_CACHE set (here a temporary directory)."""
    cache = tmp_path_factory.mktemp("fldp_cache")
    out = subprocess.run(
        [sys.executable, "-m", "fldp.data"],
        cwd=cache,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "FLDP_CACHE": str(cache)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return cache


@pytest.fixture
def snapshot_dir(tmp_path):
    d = tmp_path / "snapshots"
    d.mkdir()
    return d
