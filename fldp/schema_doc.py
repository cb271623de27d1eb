"""The configuration reference, generated from the typed configuration: one table row per key of
`fldp.config.KEYS`.

`reference_markdown()` is the docs site's page `reference/config.md` (docs/hooks.py adds it when
MkDocs builds the site), so the page lists exactly the keys `python -m fldp.train` checks, with what
each is for, its default, what it accepts (type, range or choices, null), and where it applies
(`Spec.when`), and cannot drift from them. It reads fldp/config.py only: no torch, no config is
composed.
"""

from __future__ import annotations

from .schema import KEYS, RULES, ListOf, MapOf, Section, Spec
from .spec import REQUIRED

# Where each group's keys are set; the run-level sections' defaults are fldp/config.py's.
GROUP_FILES = {
    "algorithm": "conf/algorithm/*.yaml",
    "topology": "conf/topology/*.yaml",
    "model": "conf/model/*.yaml",
    "dataset": "conf/dataset/*.yaml",
    "cluster": "conf/cluster/*.yaml",
}

_SPECIAL = "\\`*_[]|"


def _md(text: str) -> str:
    """Plain text made safe in a Markdown table cell (`2**63` stays literal, `|` ends no cell)."""
    return "".join("\\" + c if c in _SPECIAL else c for c in str(text))


def _value(v) -> str:
    """A value as a config writes it, in code: `null`, `true`, `fedavg`, `8`."""
    if v is None or isinstance(v, bool):
        return "`" + {None: "null", True: "true", False: "false"}[v] + "`"
    return f"`{v}`"


def default(spec: Spec) -> str:
    """The value a key has unless a config sets it; none where each option file of its group does."""
    if spec.default is REQUIRED or isinstance(spec, Section):
        return ""
    value = list(spec.default) if isinstance(spec.default, tuple) else spec.default
    return _md(str(value)) if isinstance(value, (list, dict)) and value else _value(value)


def _either(values) -> str:
    return " or ".join(_value(v) for v in values)


def accepts(spec: Spec) -> str:
    """What a value of this key may be, in words (Markdown)."""
    if isinstance(spec, Section):
        if not spec.fields:
            return "a mapping (its keys are the rows below it)"
        parts = []
        for name, sub in spec.fields.items():
            notes = (
                [accepts(sub)] + (["null allowed"] if sub.null else []) + (["may be absent"] if sub.optional else [])
            )
            parts.append(f"`{name}`: " + ", ".join(notes))
        return "a mapping of " + "; ".join(parts)
    if isinstance(spec, ListOf):
        parts = [_md(spec.what)]
        if spec.length is not None:
            parts.append(f"exactly {spec.length} items")
        elif spec.min_length:
            parts.append(f"at least {spec.min_length} item" + ("s" if spec.min_length > 1 else ""))
        if spec.item is not None:
            parts.append("each item " + accepts(spec.item))
        return "; ".join(parts)
    if isinstance(spec, MapOf):
        parts = [_md(spec.what)]
        if spec.keys is not None:
            parts.append("keys: " + ", ".join(f"`{k}`" for k in spec.keys))
        if spec.value is not None:
            parts.append("each value " + accepts(spec.value))
        return "; ".join(parts)
    if spec.kind == "choice":
        return "one of " + ", ".join(_value(c) for c in spec.choices)
    return _md(spec.what)


def applies(key: str, spec: Spec) -> str:
    """Where the key is a setting: its own condition, its section's, whether it may be absent."""
    notes = []
    if spec.when:
        notes.append(f"where `{spec.when[0]}` is {_either(spec.when[1])}")
    if spec.needed_when and spec.needed_when != spec.when:
        notes.append(f"needed where `{spec.needed_when[0]}` is {_either(spec.needed_when[1])}")
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):  # the nearest enclosing section with a condition
        parent = KEYS.get(".".join(parts[:n]))
        if parent is not None and parent.when:
            notes.append(f"with `{'.'.join(parts[:n])}`")
            break
    if spec.optional:
        notes.append("may be absent")
    return "; ".join(notes)


def _rule(rule) -> str:
    keys = ", ".join(f"`{k}`" for k in rule.keys)
    words = rule.requires if isinstance(rule.requires, str) else "a condition computed in `fldp/schema.py` (RULES)"
    return f"- {keys}: {_md(words)}"


def reference_markdown() -> str:
    """The whole reference page: one section per top-level name, one table row per key of KEYS."""
    groups: dict[str, list[str]] = {}
    for key in KEYS:
        groups.setdefault(key.split(".")[0], []).append(key)
    lines = [
        "# Configuration reference",
        "",
        "Every key of every config group, as `fldp/schema.py` checks it before any worker starts or any",
        "job is submitted. This page is generated, when the site is built (`fldp/schema_doc.py`), from",
        "the typed configuration `fldp/config.py`, the one place a key is declared: a new key is one",
        "field there. *Default*: the value it has unless a config sets it (the run-level sections' reach",
        "Hydra from there as `fldp_run`; a group's keys without one are set by each option's file);",
        "*accepts*: the type and range or choices; *null*: whether `null` is valid; *applies*: where the",
        "key is a setting (set elsewhere it is refused; *needed* where it must be set), and *may be",
        "absent* where variants of its group lack it (its default is then what absence means). A",
        "topology or experiment may set keys of other groups (`leonardo_512` sets the paper's whole",
        "setting); how groups and overrides compose: [Configuration](../configuration.md).",
        "",
    ]
    for group, keys in groups.items():
        where = GROUP_FILES.get(group)
        said = f"Each option's file: `{where}`." if where else "Defaults: `fldp/config.py` (Hydra's `fldp_run`)."
        header = "| key | what it is for | default | accepts | null | applies |"
        lines += [f"## `{group}`", "", said, "", header, "|---|---|---|---|---|---|"]
        for key in keys:
            spec = KEYS[key]
            lines.append(
                f"| `{key}` | {_md(spec.doc)} | {default(spec)} | {accepts(spec)} | {'yes' if spec.null else 'no'} "
                f"| {applies(key, spec)} |"
            )
        lines.append("")
    lines += [
        "## Rules across keys",
        "",
        "Checked once every key above passed its own check (a model whose shape cannot work):",
        "",
    ]
    lines += [_rule(r) for r in RULES]
    lines += [
        "",
        "Checks that need more than one group's keys (the mesh against the topology's world, an",
        "aggregating algorithm's A and federation dimension, `algorithm.federate` patterns against the",
        "model's parameters, the data) follow, before any worker starts: [When things go wrong](../reliability.md).",
        "",
    ]
    return "\n".join(lines)
