"""The SLURM pre-flight (fldp/preflight.py): before sbatch, what a job would otherwise find out on its
nodes after its wait in the queue (data, tokenizer, run directory, token cache), each problem named
with its key; a dry run lists them and exits 0, a submission stops with exit 2 and submits nothing.
And `python -m fldp.data`, which makes the token cache the job reads, and refuses a stale one."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cli, compose_cfg

from fldp import ASSETS, preflight
from fldp.data import cache_entry, load_tokenizer, prepare
from fldp.mesh import ConfigError
from fldp.validation import validate

SLURM_2X4 = ["cluster=slurm", "topology=slurm_2x4"]
# pytest's directories are in /tmp, node-local on a real cluster; the node-local check has its own test
SHARED_TMP = "cluster.node_local_dirs=[]"
SMALL = ["dataset.train_blocks=40", "dataset.eval_blocks=8"]  # a few blocks: quick to tokenise


def slurm_cfg(cache: Path, *overrides: str):
    return compose_cfg(*SLURM_2X4, f"dataset.cache_dir={cache}", *overrides)


def test_fldp_data_prints_the_cache_the_job_reads(token_cache):
    out = subprocess.run(
        [sys.executable, "-m", "fldp.data", *SLURM_2X4],
        cwd=token_cache,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "FLDP_CACHE": str(token_cache)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    path, counts = out.stdout.splitlines()[:2]
    assert re.fullmatch(
        r"dataset diodati_1649: \d{4} train and 256 eval blocks of 128 tokens \(asked: all and "
        r"256\), vocabulary 4096",
        counts,
    ), counts
    assert Path(path).parent == token_cache and Path(path).is_file()
    assert prepare(slurm_cfg(token_cache).dataset).cache == Path(path)  # what every rank will read


def test_fldp_data_names_a_bad_key(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "fldp.data", "dataset.tokenizer=/nonexistent/tok"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "FLDP_CACHE": str(tmp_path)},
    )
    assert out.returncode == 2
    assert "fldp: config error: dataset.tokenizer=/nonexistent/tok: no such tokenizer directory" in out.stderr


def test_the_shipped_corpus_passes(token_cache, tmp_path):
    assert preflight.problems(slurm_cfg(token_cache, SHARED_TMP), str(tmp_path)) == []


def test_a_dry_run_without_problems_says_so(token_cache, tmp_path):
    out = cli(
        *SLURM_2X4,
        "cluster.dry_run=true",
        SHARED_TMP,
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        env={"FLDP_CACHE": str(token_cache)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.rstrip().endswith("pre-flight: ok"), out.stdout[-2000:]


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            ["dataset.data_files.train=/nonexistent/train.jsonl"],
            "dataset.data_files.train=/nonexistent/train.jsonl: no such local file",
        ),
        (
            ["dataset.data_files.validation=/nonexistent/*.jsonl"],
            "dataset.data_files.validation=/nonexistent/*.jsonl: matches no local file",
        ),
        (
            ["dataset.data_files.train=https://example.org/train.jsonl"],
            "dataset.data_files.train=https://example.org/train.jsonl: a URL, but compute nodes have no internet: "
            "download it and set dataset.data_files.train to the local file",
        ),
        (["dataset.tokenizer=/nonexistent/tok"], "dataset.tokenizer=/nonexistent/tok: no such local directory"),
        (
            ["dataset.tokenizer=someone/tok"],
            "dataset.tokenizer=someone/tok: a hub id, but compute nodes have no "
            "internet: set dataset.tokenizer to a local directory holding the tokenizer",
        ),
        (
            ["dataset=clean_mc4_it"],
            "dataset.path=gsarti/clean_mc4_it: a hub id, but compute nodes have no internet: "
            "set CLEAN_MC4_IT (or dataset.path) to a local copy",
        ),
        (
            ["dataset=clean_mc4_it"],
            "dataset.tokenizer=meta-llama/Llama-3.1-8B: a hub id, but compute nodes have no "
            "internet: set LLAMA31_TOKENIZER (or dataset.tokenizer) to a local directory",
        ),
        (
            ["dataset=clean_mc4_it", "dataset.path=/nonexistent/mc4"],
            "dataset.path=/nonexistent/mc4: no such local directory",
        ),
    ],
    ids=["file", "glob", "url", "tokenizer-dir", "tokenizer-hub", "path-hub", "tokenizer-hub-env", "path-dir"],
)
def test_data_that_compute_nodes_cannot_read_is_named(tmp_path, monkeypatch, overrides, expected):
    monkeypatch.delenv("CLEAN_MC4_IT", raising=False)
    monkeypatch.delenv("LLAMA31_TOKENIZER", raising=False)
    found = preflight.problems(slurm_cfg(tmp_path, SHARED_TMP, *overrides), str(tmp_path))
    assert any(p.startswith(expected) for p in found), found
    # the cache is named by the tokenizer and the source: it waits for them, saying how to make it
    assert found[-1] == (
        f"dataset.cache_dir={tmp_path}: not checked until the problems above are fixed; then "
        f"make the token cache with `python -m fldp.data [the same overrides as this run]`"
    )


def test_a_missing_cache_is_named_with_the_command_that_makes_it(tmp_path):
    (found,) = preflight.problems(slurm_cfg(tmp_path / "empty", SHARED_TMP), str(tmp_path))
    assert found.startswith(f"dataset.cache_dir={tmp_path / 'empty'}: no token cache of dataset diodati_1649")
    assert re.search(
        rf"make it here first with `python -m fldp.data .*` \(it writes {tmp_path / 'empty'}/diodati_1649-"
        r"\w+\.pt\)$",
        found,
    )


def test_node_local_paths_are_refused(token_cache, tmp_path):
    """A multi-node job's records in a directory each node has its own of; also the cache it reads."""
    assert list(compose_cfg("cluster=slurm").cluster.node_local_dirs) == ["/tmp", "/var/tmp", "/dev/shm"]
    found = preflight.problems(slurm_cfg(token_cache), "/dev/shm/fldp-run")
    assert (
        "hydra.run.dir=/dev/shm/fldp-run: node-local (/dev/shm is not shared with the job's 2 node(s)): choose "
        "a directory on a shared filesystem (or drop /dev/shm from cluster.node_local_dirs if it is shared "
        "here)"
    ) in found
    local, shared = tmp_path / "local", tmp_path / "shared"
    cfg = slurm_cfg(
        local / "cache", *SMALL, f"cluster.node_local_dirs=[{local}]", f"cluster.folder={local / 'submitit'}"
    )
    prepare(cfg.dataset)
    keys = [p.split("=")[0] for p in preflight.problems(cfg, str(local / "run"))]
    assert keys == ["hydra.run.dir", "dataset.cache_dir", "cluster.folder"]
    assert preflight.problems(cfg, str(shared / "run")) == [
        p for p in preflight.problems(cfg, str(local / "run")) if not p.startswith("hydra.run.dir")
    ]
    with pytest.raises(ConfigError, match=r"cluster.node_local_dirs='/tmp': must be a list of directories"):
        validate(slurm_cfg(token_cache, "cluster.node_local_dirs=/tmp"))


def test_a_dry_run_lists_every_problem_and_exits_0(tmp_path):
    out = cli(
        *SLURM_2X4,
        "cluster.dry_run=true",
        "dataset.data_files.train=/nonexistent/train.jsonl",
        "dataset.tokenizer=/nonexistent/tok",
        f"cluster.node_local_dirs=[{tmp_path}]",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        env={"FLDP_CACHE": str(tmp_path / "cache")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = out.stdout[out.stdout.index("pre-flight: 5 problem(s):") :]
    for key in (
        "dataset.data_files.train=/nonexistent/train.jsonl: no such local file",
        "dataset.tokenizer=/nonexistent/tok: no such local directory",
        f"hydra.run.dir={tmp_path / 'run'}: node-local",
        f"dataset.cache_dir={tmp_path / 'cache'}: node-local",
        f"dataset.cache_dir={tmp_path / 'cache'}: not checked until the problems above are fixed; then make "
        f"the token cache with `python -m fldp.data topology=slurm_2x4 dataset.data_files.train=",
    ):
        assert f"\n  - {key}" in report, report
    assert not (tmp_path / "run" / "slurm").exists()


def test_a_submission_with_problems_exits_2_and_submits_nothing(tmp_path):
    """A SLURM whose sbatch and srun only record that they were called: nothing may call them."""
    bin_dir, called = tmp_path / "bin", tmp_path / "called"
    bin_dir.mkdir()
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho {tool} >> {called}\nexit 1\n")
        (bin_dir / tool).chmod(0o755)
    run = tmp_path / "run"
    out = cli(
        *SLURM_2X4,
        "dataset.tokenizer=/nonexistent/tok",
        SHARED_TMP,
        f"hydra.run.dir={run}",
        cwd=tmp_path,
        env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FLDP_CACHE": str(tmp_path / "cache")},
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert (
        "fldp: config error: nothing submitted; pre-flight: 2 problem(s):\n"
        "  - dataset.tokenizer=/nonexistent/tok: no such local directory\n"
        f"  - dataset.cache_dir={tmp_path / 'cache'}: not checked" in out.stderr
    ), out.stderr[-3000:]
    assert not called.exists() and not (run / "slurm").exists()


def copy_of_the_corpus(tmp_path) -> list[str]:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split in ("train", "validation"):
        shutil.copy2(ASSETS / f"diodati_1649/{split}.jsonl.gz", corpus)
    return [f"dataset.data_files.{split}={corpus / split}.jsonl.gz" for split in ("train", "validation")]


def test_a_changed_source_file_makes_the_cache_a_miss(tmp_path):
    cfg = slurm_cfg(tmp_path / "cache", *copy_of_the_corpus(tmp_path), *SMALL, SHARED_TMP)
    first = prepare(cfg.dataset)
    assert preflight.problems(cfg, str(tmp_path)) == []
    train = tmp_path / "corpus" / "train.jsonl.gz"
    st = train.stat()
    os.utime(train, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: same content, a second later
    (found,) = preflight.problems(cfg, str(tmp_path))
    assert "no token cache of dataset diodati_1649" in found
    again = prepare(cfg.dataset)
    assert again.cache != first.cache and first.cache.exists()  # the old file is not used
    assert preflight.problems(cfg, str(tmp_path)) == []


@pytest.mark.parametrize("made_with", ["block_size_64", "an_older_fldp"])
def test_a_cache_made_from_something_else_is_refused_here_and_remade_locally(tmp_path, caplog, made_with):
    """A file under the expected name that holds other blocks (copied, renamed): the pre-flight
    refuses it, naming the file and what differs; prepare() (local runs, fldp.data) makes it again."""
    cfg = slurm_cfg(tmp_path, *SMALL, SHARED_TMP)
    expected, _ = cache_entry(cfg.dataset, load_tokenizer(str(cfg.dataset.tokenizer)))
    if made_with == "block_size_64":
        shutil.copy(prepare(slurm_cfg(tmp_path, *SMALL, "dataset.block_size=64").dataset).cache, expected)
        differs = "it was made from dataset.block_size=64 (now 128)"
    else:
        torch.save(
            {
                "train": torch.zeros(40, 128, dtype=torch.int32),
                "eval": torch.zeros(8, 128, dtype=torch.int32),
                "vocab_size": 4096,
            },
            expected,
        )
        differs = "it records nothing of what it was made from (an older fldp wrote it)"
    assert preflight.problems(cfg, str(tmp_path)) == [
        f"dataset.cache_dir: {expected} does not match this dataset and tokenizer: {differs}: make it again with "
        f"`python -m fldp.data [the same overrides as this run]`"
    ]
    with caplog.at_level("WARNING", logger="fldp"):
        blocks = prepare(cfg.dataset)
    assert f"{expected} does not match" in caplog.text and "tokenising again" in caplog.text
    assert blocks.cache == expected and blocks.train.shape == (40, 128) and int(blocks.train.max()) > 0
    assert preflight.problems(cfg, str(tmp_path)) == []
