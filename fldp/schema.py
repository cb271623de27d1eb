"""The schema of the composed config: every key of every config group, its type and range or choices.

`check(cfg)` runs first in `fldp.validation.validate`, before any worker starts or any job is submitted.
It resolves every interpolation (`${oc.env:...}`, `${topology...}`) and refuses, naming the key, the
value and what would be valid:
- a key the schema does not know, also one added with `+` (`+trainer.step=4`), with the nearest
  known key; group appends (`+experiment=...`) add known keys only and pass;
- a key that is missing, or belongs to another variant of its group (`cluster.dry_run` on
  `cluster=local`, which has no `cluster.launcher`);
- a value of the wrong type or out of range (`seed=abc`, `optimizer.lr=-1`);
- a model whose shape cannot work (RULES: heads dividing the hidden size, ...).

The keys are fldp/config.py's typed configuration (`KEYS`, `FIELDS`); the checks that need several
keys of one group stay here (RULES), those of other groups where their values meet (`mesh_shape`,
`FedAvgConfig`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig, ListConfig
from omegaconf.errors import OmegaConfBaseException

from .config import (  # noqa: F401  (the choices, as before, for their users)
    FEDAVG,
    FIELDS,
    KEYS,
    LAYOUTS,
    MODES,
    OUTER,
    QUANTIZE,
    REDUCE_DTYPES,
    ROPE_TYPES,
    SLURM,
)
from .errors import ConfigError
from .spec import UNRESOLVED, Checker, ListOf, MapOf, Section, Spec, _join, show  # noqa: F401  (tests read them here)


@dataclass(frozen=True)
class Rule:
    """A condition over several keys (their checked values, in order) and what it requires (words,
    or a function of the values giving them)."""

    keys: tuple
    holds: Callable
    requires: str | Callable


ROPE_NEEDS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

RULES = (
    Rule(
        ("model.hidden_size", "model.num_attention_heads"),
        lambda h, n: h % n == 0,
        "model.num_attention_heads must divide model.hidden_size",
    ),
    Rule(
        ("model.hidden_size", "model.num_attention_heads"),
        lambda h, n: h % n or h // n % 2 == 0,
        "the head dimension model.hidden_size / model.num_attention_heads must be even (RoPE rotates pairs)",
    ),
    Rule(
        ("model.num_attention_heads", "model.num_key_value_heads"),
        lambda n, k: n % k == 0,
        "model.num_key_value_heads must divide model.num_attention_heads (grouped-query attention)",
    ),
    Rule(
        ("model.rope_scaling",),
        lambda r: r is None or set(ROPE_NEEDS.get(r["rope_type"], ())) <= r.keys(),
        lambda r: f"rope_type {r['rope_type']} needs {', '.join(ROPE_NEEDS[r['rope_type']])} (transformers)",
    ),
)


SCHEMA = Section(fields=FIELDS)


def plain(node, key: str = "", sources: dict | None = None, errors: dict | None = None):
    """The config as plain Python, every interpolation resolved. `sources[key]`: the interpolation a
    value came from (for messages); `errors[key]`: why one could not be resolved (its value is then
    UNRESOLVED, and the other keys are still checked)."""
    sources = {} if sources is None else sources
    errors = {} if errors is None else errors
    try:
        if node._is_interpolation():
            sources[key] = node._value()
            node = node._dereference_node()
        missing = node._is_missing()
    except OmegaConfBaseException as e:
        errors[key] = f"{key}={node._value()}: cannot be resolved ({type(e).__name__}: {str(e).splitlines()[0]})"
        return UNRESOLVED
    if missing:
        errors[key] = f"{key}=???: a value is missing"
        return UNRESOLVED
    if isinstance(node, DictConfig) and not node._is_none():
        return {str(k): plain(node._get_node(k), _join(key, k), sources, errors) for k in node.keys()}
    if isinstance(node, ListConfig) and not node._is_none():
        return [plain(node._get_node(i), f"{key}[{i}]", sources, errors) for i in range(len(node))]
    return node._value()


def _rules(check: Checker) -> None:
    """The rules whose keys all passed their own checks."""

    def affected(k):  # the key, a key inside it, or a section holding it failed
        return any(f == k or f.startswith((k + ".", k + "[")) or k.startswith(f + ".") for f in check.failed)

    for rule in RULES:
        if any(affected(k) for k in rule.keys):
            continue
        values = [check.lookup(k) for k in rule.keys]
        if not rule.holds(*values):
            shown = ", ".join(f"{k}={show(v)}" for k, v in zip(rule.keys, values))
            words = rule.requires(*values) if callable(rule.requires) else rule.requires
            check.problems.append(f"{shown}: {words}")


def problems(cfg) -> list[str]:
    """Every problem of a composed config (a DictConfig or a plain dict), as `key=value: what's wrong`."""
    sources: dict = {}
    errors: dict = {}
    root = plain(cfg, "", sources, errors) if isinstance(cfg, DictConfig) else cfg
    check = Checker(root, sources)
    check.problems.extend(errors.values())
    check.section("", root, SCHEMA)
    _rules(check)
    return check.problems


def check(cfg) -> None:
    """Raise ConfigError listing every problem of a composed config."""
    found = problems(cfg)
    if len(found) == 1:
        raise ConfigError(found[0])
    if found:
        raise ConfigError(f"{len(found)} settings are invalid:\n  " + "\n  ".join(found))


def check_values(values: dict) -> None:
    """Check a few keys (dotted, as in KEYS) outside a whole config: the dataclasses built from them."""
    found = Checker({}, {})
    for key, value in values.items():
        found.value(key, value, KEYS[key])
    if found.problems:
        raise ConfigError("; ".join(found.problems))
