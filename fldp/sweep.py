"""Sweep points: the directory each point of a Hydra multirun writes, and whether it runs again.

A point's directory (`hydra.sweep.subdir`, conf/config.yaml) is named by its overrides, as Hydra's
`${hydra.job.override_dirname}` is: `key=value` joined by `,`, sorted (so the order Hydra numbers
the points in does not matter), less the keys that do not change what a run computes
(`hydra.job.config.override_dirname.exclude_keys`: resuming, progress, W&B, dry run), e.g.
`algorithm.every=4,mesh.federation=4`. Unlike Hydra's, a key given twice counts once, with the
value that wins (the last), and the name is one path component of at most 255 bytes.

Re-running a multirun into the same `hydra.sweep.dir` skips each point whose directory holds
`summary.json` (written last, atomically: the run finished); `trainer.skip_finished=false` does not.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import OmegaConf

NAME_MAX = 255  # bytes in one path component (ext4, XFS, Btrfs, Lustre, GPFS, NFS)
HASH_CHARS = 16  # hex digits of SHA-256 that end a shortened name (64 bits)
NO_OVERRIDES = "defaults"  # has no '=', so no point with an override (key=value, ~key) is named so


def point_dirname(overrides, exclude_keys=()) -> str:
    """The directory of the sweep point with these overrides (`hydra.overrides.task`)."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    # the last value of a key wins, as Hydra applies them: `trainer.steps=2 trainer.steps=1` is
    # the point `trainer.steps=1`, whichever order the two come in
    last = {(o.key_or_group, o.package): str(o.input_line) for o in parsed if o.key_or_group not in exclude_keys}
    return component(",".join(sorted(last.values())))


def component(name: str) -> str:
    """A name as one path component: `%`, `/` and `#` escaped as `%25`, `%2F`, `%23` (reversible,
    so two names never meet; `/` would nest directories or climb out with `..`); past NAME_MAX
    bytes, its head, `#` and a hash of the whole."""
    if not name:
        return NO_OVERRIDES
    name = name.replace("%", "%25").replace("/", "%2F").replace("#", "%23")
    raw = name.encode()
    if len(raw) <= NAME_MAX:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:HASH_CHARS]
    # cut on a character boundary; the only '#' is the one before the hash, the others being %23
    head = raw[: NAME_MAX - 1 - HASH_CHARS].decode(errors="ignore")
    return f"{head}#{digest}"


def finished(run_dir: str | Path) -> bool:
    return (Path(run_dir) / "summary.json").is_file()


def skips(run_dir: str | Path, multirun: bool, skip_finished) -> bool:
    """A multirun point that already finished is not run again. Only a boolean true skips: any
    other value of trainer.skip_finished goes on to the schema, which refuses it."""
    return multirun and skip_finished is True and finished(run_dir)


def refused(run_dir: str | Path, resume) -> bool:
    """A run directory holding records or checkpoints that this run would not continue
    (fldp.validation.check_run_dir refuses it, naming trainer.resume=auto). Checkpoints count alone: a
    fresh run beside another's would later resume from that one's newest, of another timeline."""
    path = Path(run_dir)
    held = (path / "metrics.jsonl").exists() or any((path / "checkpoints").glob("step_*"))
    return held and resume != "auto"


def hydra_output_subdir(name: str, *, _root_) -> str | None:
    """hydra.output_subdir: Hydra writes the run's config into `.hydra/` before the run starts. Not
    into a directory whose records this run leaves alone (a skipped point, a refused run): its
    `.hydra/` stays the config its records came from, which the analysis reads."""

    def get(key):
        return OmegaConf.select(_root_, key, throw_on_resolution_failure=False)

    run_dir = get("hydra.runtime.output_dir")
    if run_dir is None:
        return name
    multirun = get("hydra.mode") == RunMode.MULTIRUN
    if skips(run_dir, multirun, get("trainer.skip_finished")) or refused(run_dir, get("trainer.resume")):
        return None
    return name
