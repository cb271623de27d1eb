"""Sweep points: the directory each point of a Hydra multirun writes.

A point's directory (`hydra.sweep.subdir`, conf/config.yaml) is named by its overrides, as Hydra's
`${hydra.job.override_dirname}` is: `key=value` joined by `,`, sorted (so the order Hydra numbers
the points in does not matter), less the keys that do not change what a run computes
(`hydra.job.config.override_dirname.exclude_keys`: resuming, progress, W&B, dry run), e.g.
`algorithm.every=4,mesh.federation=4`. Unlike Hydra's, a key given twice counts once, with the
value that wins (the last), and the name is one path component of at most 255 bytes.
"""
from __future__ import annotations

import hashlib

from hydra.core.override_parser.overrides_parser import OverridesParser

NAME_MAX = 255      # bytes in one path component (ext4, XFS, Btrfs, Lustre, GPFS, NFS)
HASH_CHARS = 16     # hex digits of SHA-256 that end a shortened name (64 bits)
NO_OVERRIDES = "defaults"   # has no '=', so no point with an override (key=value, ~key) is named so


def point_dirname(overrides, exclude_keys=()) -> str:
    """The directory of the sweep point with these overrides (`hydra.overrides.task`)."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    # the last value of a key wins, as Hydra applies them: `trainer.steps=2 trainer.steps=1` is
    # the point `trainer.steps=1`, whichever order the two come in
    last = {(o.key_or_group, o.package): o.input_line for o in parsed if o.key_or_group not in exclude_keys}
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
    head = raw[:NAME_MAX - 1 - HASH_CHARS].decode(errors="ignore")
    return f"{head}#{digest}"
