"""The typed configuration (fldp/config.py) is the one source of every key: its type and range, its
description and its default. The composed config's run-level sections come from it, the schema's
words are its, a component's own config checks with them, and the compressions it offers are the
codecs fldp/quantize.py has."""

from __future__ import annotations

import pytest
import yaml
from conftest import ROOT
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from fldp import config, schema
from fldp.errors import ConfigError
from fldp.outer import OuterConfig
from fldp.quantize import CODECS
from fldp.spec import REQUIRED, Section
from fldp.streaming import StreamingConfig

RUN_SECTIONS = [name for name in config.FIELDS if name not in config.GROUPS]


def test_the_run_level_sections_are_composed_from_the_typed_defaults_and_written_nowhere_else():
    written = yaml.safe_load((ROOT / "conf" / "config.yaml").read_text())
    assert not set(written) & set(RUN_SECTIONS), "conf/config.yaml repeats a section fldp/config.py declares"
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config")
    composed = OmegaConf.to_container(cfg, resolve=False)
    checked = 0
    for key, spec in config.KEYS.items():
        if key.split(".")[0] in RUN_SECTIONS and not isinstance(spec, Section):
            assert _at(composed, key) == config.default_of(key), key
            checked += 1
    assert checked == 31  # mesh 3, seed, trainer 11, fsdp 2, optimizer 7, comm 3, wandb 4


def _at(tree: dict, key: str):
    for part in key.split("."):
        tree = tree[part]
    return tree


def test_every_key_says_what_it_is_for_and_an_optional_or_run_level_key_its_default():
    for key, spec in config.KEYS.items():
        assert spec.doc, f"{key}: no description"
        if spec.optional or key.split(".")[0] in RUN_SECTIONS:
            assert isinstance(spec, Section) or spec.default is not REQUIRED, f"{key}: no default"


def test_a_default_is_a_value_its_key_accepts():
    for key, spec in config.KEYS.items():
        if spec.default is REQUIRED or isinstance(spec, Section) or "${" in str(spec.default):
            continue
        if spec.default is None and spec.optional and not spec.null:
            continue  # absent, not null: a key variants of its group lack
        found = schema.Checker({}, {})
        found.value(key, list(spec.default) if isinstance(spec.default, tuple) else spec.default, spec)
        assert not found.problems, found.problems


@pytest.mark.parametrize(
    "make, key, value",
    [
        (lambda: OuterConfig(momentum=1.5), "algorithm.outer.momentum", 1.5),
        (lambda: OuterConfig(quantize="int2"), "algorithm.outer.quantize", "int2"),
        (lambda: StreamingConfig(layout="diagonal"), "algorithm.streaming.layout", "diagonal"),
        (lambda: StreamingConfig(fragments=0), "algorithm.streaming.fragments", 0),
    ],
)
def test_a_components_config_refuses_a_value_in_the_schemas_own_words(make, key, value):
    with pytest.raises(ConfigError) as refused:
        make()
    composed = {"algorithm": {"outer" if "outer" in key else "streaming": {key.rsplit(".", 1)[1]: value}}}
    words = schema.Checker(composed, {})
    words.value(key, value, config.KEYS[key])
    assert str(refused.value) == words.problems[0]


def test_the_compressions_offered_are_the_codecs_there_are():
    assert set(config.QUANTIZE) == set(CODECS)
    for kind in config.QUANTIZE:
        codec = CODECS[kind](kind, 4)
        for method in ("chunk", "wire_bytes", "mean", "all_reduce_mean", "residual"):
            assert callable(getattr(codec, method)), (kind, method)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["algorithm=fl_hsdp", "cluster=simulate"],
        ["algorithm=diloco_hsdp", "topology=leonardo_512", "cluster=leonardo", "cluster.account=x"],
        ["algorithm=fl_fsdp", "algorithm.streaming.fragments=2", "algorithm.outer.name=adam"],
    ],
)
def test_the_loaded_config_holds_every_composed_value_and_the_declared_default_of_each_absent_key(overrides):
    """fldp.config.load: the run's typed config, read key by key against the composition itself."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    schema.check(cfg)
    loaded = config.load(cfg)
    composed = OmegaConf.to_container(cfg, resolve=True)
    outer = config.OUTER_DEFAULTS[loaded.algorithm.outer.name]
    checked = 0
    for key, spec in config.KEYS.items():
        if isinstance(spec, Section) or any(_has(composed, p) and _at(composed, p) is None for p in _parents(key)):
            continue
        value = _attr(loaded, key)
        if _has(composed, key) and not (key.startswith("algorithm.outer.") and _at(composed, key) is None):
            expected = _at(composed, key)
        elif key.startswith("algorithm.outer.") and key.split(".")[-1] in outer:
            expected = outer[key.split(".")[-1]]  # OuterConfig's null lr / eps mean its optimiser's
        else:
            expected = config.default_of(key) if spec.default is not REQUIRED else REQUIRED
        assert (list(value) if isinstance(value, tuple) else value) == expected, key
        checked += 1
    assert checked > 100


def _has(tree: dict, key: str) -> bool:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def _parents(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _attr(obj, key: str):
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def test_loading_refuses_a_key_the_typed_config_lacks():
    with pytest.raises(ConfigError, match="colour: not keys of TrainerConfig"):
        config.build(config.TrainerConfig, {"steps": 3, "colour": "red"})
