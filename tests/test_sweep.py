"""Sweeps: each point's directory names its overrides."""
from __future__ import annotations

import re

from omegaconf import OmegaConf

from conftest import QUICK, ROOT, cli, compose_cfg
from fldp import schema
from fldp.records import WANDB_NAME_MAX, wandb_name
from fldp.setting import defining
from fldp.sweep import NAME_MAX, NO_OVERRIDES, point_dirname


def test_a_long_point_name_is_cut_with_a_hash(tmp_path):
    """Past 255 bytes (the file systems' limit on one path component, where Hydra's own name
    would fail), the name keeps its head and ends in a hash of the whole; a `/` in a value is
    escaped, not a subdirectory. The points fail fast (F=3 does not fit 2 ranks): only their
    directories matter here."""
    long_name = "tiny/" + "x" * 300
    out = cli("-m", "topology=local_2", "mesh.federation=3", f"model.name={long_name}", "seed=1,2", *QUICK,
              f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, timeout=120)
    log = out.stdout + out.stderr
    assert "File name too long" not in log
    assert log.count("failed: mesh.federation x mesh.replicate x mesh.shard = 3x") == 2, log[-3000:]
    points = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert len(points) == 2
    heads = set()
    for name in points:
        assert len(name.encode()) <= NAME_MAX
        head, digest = name.rsplit("#", 1)
        assert re.fullmatch(r"[0-9a-f]{16}", digest)
        assert head.startswith("mesh.federation=3,model.name=tiny%2Fxxx")  # seed=... sorts last, cut off
        heads.add(head)
    assert len(heads) == 1  # the two points differ only in the hash of what was cut


def test_point_names():
    """The name is a function of the overrides a point has, not of their order or repetition, and
    two different override lists never share one."""
    assert point_dirname(["b=2", "a=1"]) == point_dirname(["a=1", "b=2"]) == "a=1,b=2"
    # Hydra applies the last of a key's values; +key and key are one key
    assert point_dirname(["a=2", "b=1", "a=1"]) == "a=1,b=1"
    assert point_dirname(["+a=1", "a=2"]) == "a=2"
    assert point_dirname(["a=1", "wandb.mode=offline"], ["wandb.mode"]) == "a=1"
    assert point_dirname([]) == point_dirname(["wandb.mode=offline"], ["wandb.mode"]) == NO_OVERRIDES
    # escapes are reversible: what would otherwise read alike stays apart
    names = [point_dirname([o]) for o in ("a=x/y", "a=x%2Fy", "a=x%252Fy", "a='x#y'", "a='x%23y'")]
    assert len(set(names)) == len(names) and not any("/" in n for n in names)
    assert point_dirname(["a=../../etc"]) == "a=..%2F..%2Fetc"
    # cut on a character boundary: 2-byte characters, an odd number of bytes left for them
    cut = point_dirname([f"a='{'é' * 200}'"])
    assert len(cut.encode()) <= NAME_MAX and cut.startswith("a='é") and "\ufffd" not in cut
    assert point_dirname([f"a='{'é' * 200}'"]) == cut and point_dirname([f"a='{'é' * 201}'"]) != cut


def test_excluded_keys_define_no_experiment():
    """Two points differing only in an excluded key share a directory, so the second is skipped:
    right only if they compute the same thing. Each excluded key is a setting (the schema knows
    it) that does not define an experiment (fldp.setting) and is not the seed."""
    excluded = OmegaConf.load(ROOT / "conf" / "config.yaml").hydra.job.config.override_dirname.exclude_keys
    assert "trainer.resume" in excluded
    config = OmegaConf.to_container(compose_cfg(), resolve=False)
    for key in excluded:
        assert key in schema.KEYS, key
        assert key not in defining(config) and key != "seed", key


def test_wandb_names_stay_short_and_distinct(tmp_path):
    cfg = compose_cfg("topology=local_2", "algorithm=fl_fsdp")
    assert wandb_name(cfg, tmp_path / "a=1") == "fl_fsdp-local_2-a=1"
    names = {wandb_name(cfg, tmp_path / point_dirname([f"model.name={'x' * 300}", f"seed={s}"])) for s in (1, 2)}
    assert len(names) == 2 and all(len(n) <= WANDB_NAME_MAX for n in names)
