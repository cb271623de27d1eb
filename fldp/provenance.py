"""Where a run's numbers came from: the git commit of the fldp that ran, the versions of what
computed them, the command and the host. summary.json and the W&B config carry it; the analysis
refuses to pool runs of different commits unless asked (analysis.discover)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shlex
import socket
import subprocess
from pathlib import Path

# the command that started the run, set by fldp.train.cli; forked workers and SLURM jobs inherit it
COMMAND_VARIABLE = "FLDP_COMMAND"
PACKAGES = ("fldp", "torch", "transformers", "hydra-core", "omegaconf", "datasets")
# the machine's name, read when fldp is imported (in the launcher, before it forks): a worker on an
# emulated node (fldp.netns) carries its node's name instead
HOST = socket.gethostname()


def record_command(args: list[str]) -> None:
    """Keep the command line for the records (a run's ranks and jobs see only their own argv)."""
    os.environ.setdefault(COMMAND_VARIABLE, shlex.join(["python", "-m", "fldp.train", *args]))


def provenance() -> dict:
    """What a summary records beside its setting: the command, the host, python and the versions."""
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "command": os.environ.get(COMMAND_VARIABLE),
        "host": HOST,
        "python": platform.python_version(),
        "versions": versions,
    }


def _git_commit() -> str | None:
    root = Path(__file__).resolve().parents[1]
    git = ["git", "-C", str(root)]
    try:
        head = subprocess.run(
            [*git, "rev-parse", "--show-toplevel", "HEAD"], capture_output=True, text=True, timeout=10
        )
        # only fldp's own checkout: an installed fldp inside another repository (a venv in a
        # checkout) is not that repository's code
        if head.returncode != 0 or Path(head.stdout.split()[0]).resolve() != root:
            return None
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.split()[1] + ("-dirty" if dirty else "")


# Read once, when fldp is imported: the commit of the code this process runs. Read at the end of a
# run instead, it named whatever the checkout held by then (a long sweep outlives several commits).
_COMMIT_AT_IMPORT = _git_commit()


def source_commit() -> str | None:
    """The git commit of the fldp this process imported, '-dirty' if its tracked files had changes
    then; None outside a git checkout (an installed wheel)."""
    return _COMMIT_AT_IMPORT


def version_line() -> str:
    """What `fldp-train --version` prints: fldp's version and the commit of the code imported."""
    try:
        version = importlib.metadata.version("fldp")
    except importlib.metadata.PackageNotFoundError:
        version = "(not installed)"
    return f"fldp {version}, commit {source_commit() or 'unknown (not run from a git checkout of fldp)'}"


def run_fields() -> dict:
    """What summary.json and the W&B config record of where a run came from: `commit` (the key
    the analysis reads) and `provenance`."""
    return {"commit": source_commit(), "provenance": provenance()}
