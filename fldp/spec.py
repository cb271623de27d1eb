"""The vocabulary of the typed configuration: what a key accepts (`Spec` and its kinds), how a typed
config's field declares it (`setting`, `section`), and the walk that checks values against specs,
collecting every problem (`Checker`).

fldp/config.py declares every key with these; fldp/schema.py checks a composed config with them;
fldp/schema_doc.py and tests/test_config_fuzz.py read them. No torch, no Hydra: a refused config
costs only this.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # the default of a key each option file of its group sets: none
UNRESOLVED = object()  # a value whose interpolation failed (reported once, as such: fldp.schema.plain)


@dataclass(frozen=True)
class Spec:
    """What one key accepts. `what` says it in words (error messages). `null`: null is valid too;
    `optional`: the key may be absent (variants of its group lack it); `when` = (key, values): the key
    is a setting only where that other key has one of those values (the SLURM clusters' keys: set on
    cluster=local, they would silently do nothing), and needed there (or where `needed_when` holds)
    unless optional."""

    what: str
    test: Callable[[Any], bool] = lambda v: True  # containers: their parts are checked instead
    null: bool = False
    optional: bool = False
    when: tuple | None = None
    needed_when: tuple | None = None  # (key, values) where it is needed, if narrower than `when`
    kind: str = "custom"  # int, num, bool, text, choice, section, list, map: what a fuzzer draws
    bounds: tuple = ()  # int, num: (ge, gt, le, lt)
    choices: tuple = ()  # choice
    doc: str = ""  # what the key is for (the reference's description)
    default: Any = REQUIRED  # the value it has unless a config sets it (REQUIRED: its group's file sets it)

    def __str__(self) -> str:
        return self.what + (" or null" if self.null else "")

    def accepts(self, value) -> bool:
        if value is None:
            return self.null
        try:
            return bool(self.test(value))
        except (TypeError, ValueError, re.error):
            return False


@dataclass(frozen=True)
class Section(Spec):
    """A mapping with fixed keys, each with its Spec (`fields`); a dotted key's parent."""

    what: str = "a mapping"
    kind: str = "section"
    fields: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ListOf(Spec):
    """A list whose items each satisfy `item` (a Spec or a Section), of `length` items if given."""

    what: str = "a list"
    kind: str = "list"
    item: Spec = None  # type: ignore[assignment]  # every ListOf names one (keyword-only in spirit)
    length: int | None = None
    min_length: int = 0


@dataclass(frozen=True)
class MapOf(Spec):
    """A mapping with open keys (or only `keys`), every value satisfying `value`."""

    what: str = "a mapping"
    kind: str = "map"
    value: Spec = None  # type: ignore[assignment]  # every MapOf names one
    keys: tuple | None = None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bounds(ge, gt, le, lt) -> tuple[str, Callable]:
    """Words and test for a range: `>= 1`, `in [0, 1)`, ..."""
    low = (ge, "[", lambda v: v >= ge) if ge is not None else (gt, "(", lambda v: v > gt) if gt is not None else None
    high = (le, "]", lambda v: v <= le) if le is not None else (lt, ")", lambda v: v < lt) if lt is not None else None
    if low and high:
        return f" in {low[1]}{low[0]:g}, {high[0]:g}{high[1]}", lambda v: low[2](v) and high[2](v)
    if low:
        return f" {'>=' if low[1] == '[' else '>'} {low[0]:g}", low[2]
    if high:
        return f" {'<=' if high[1] == ']' else '<'} {high[0]:g}", high[2]
    return "", lambda v: True


def Int(ge=None, gt=None, le=None, lt=None, **kw) -> Spec:
    words, inside = _bounds(ge, gt, le, lt)
    return Spec("an integer" + words, lambda v: _is_int(v) and inside(v), kind="int", bounds=(ge, gt, le, lt), **kw)


def Num(ge=None, gt=None, le=None, lt=None, **kw) -> Spec:
    """A finite number; integers count (Hydra reads `lr=1` as one)."""
    words, inside = _bounds(ge, gt, le, lt)
    return Spec("a number" + words, lambda v: _is_number(v) and inside(v), kind="num", bounds=(ge, gt, le, lt), **kw)


def Bool(**kw) -> Spec:
    return Spec("true or false", lambda v: isinstance(v, bool), kind="bool", **kw)


def Text(**kw) -> Spec:
    """A non-empty string; a number too, since Hydra reads `cluster.account=12345` as one."""
    return Spec("a string", lambda v: (isinstance(v, str) and v != "") or _is_number(v), kind="text", **kw)


def Choice(*values, **kw) -> Spec:
    words = ", ".join("null" if v is None else str(v) for v in values)
    return Spec(
        f"one of {words}",
        lambda v: any(v == c and type(v) is type(c) for c in values),
        null=None in values,
        kind="choice",
        choices=values,
        **kw,
    )


def show(value) -> str:
    """A value as in a config: true, null, 'text', [0.9]."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value)


def _join(key: str, name) -> str:
    return f"{key}.{name}" if key else str(name)


class Checker:
    """One pass over a plain config: every problem found, as `key=value: ...` lines."""

    def __init__(self, root: dict, sources: dict):
        self.root, self.sources = root, sources
        self.problems: list[str] = []
        self.failed: set[str] = set()

    def bad(self, key: str, value, must: str) -> None:
        origin = f" (from {self.sources[key]})" if key in self.sources else ""
        self.problems.append(f"{key}={show(value)}{origin}: {must}")
        self.failed.add(key)

    def missing(self, key: str, spec: Spec) -> None:
        self.problems.append(f"{key}: missing; must be {spec}")
        self.failed.add(key)

    def holds(self, when: tuple) -> bool:
        return self.lookup(when[0]) in when[1]

    def lookup(self, key: str):
        value: Any = self.root
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        return value

    def value(self, key: str, value, spec: Spec) -> None:
        if value is UNRESOLVED:
            self.failed.add(key)
        elif isinstance(spec, Section):
            self.section(key, value, spec)
        elif isinstance(spec, MapOf):
            self.mapping(key, value, spec)
        elif isinstance(spec, ListOf):
            self.items(key, value, spec)
        elif not spec.accepts(value):
            self.bad(key, value, f"must be {spec}")

    def section(self, key: str, value, spec: Section) -> None:
        if value is None and spec.null:
            return
        if not isinstance(value, dict):
            return self.bad(
                key, value, f"must be a mapping of {', '.join(spec.fields)}" + (" or null" if spec.null else "")
            )
        needed, misplaced = [], []  # a variant's keys, told once per condition (a SLURM cluster's 14)
        for name, sub in spec.fields.items():
            if name not in value and not sub.optional:
                if sub.when is None:
                    self.missing(_join(key, name), sub)
                elif self.holds(sub.needed_when or sub.when):
                    needed.append((_join(key, name), sub))
        for name, v in value.items():
            sub = spec.fields.get(name)
            where = _join(key, name)
            if sub is None:
                near = difflib.get_close_matches(name, spec.fields, n=1)
                self.bad(
                    where,
                    v,
                    "no such setting"
                    + (f" (did you mean {_join(key, near[0])}?)" if near else "")
                    + f"; {key or 'the config'} has: {', '.join(spec.fields)}",
                )
            elif sub.when and not self.holds(sub.when):
                misplaced.append((where, sub))
            else:
                self.value(where, v, sub)
        for keys in (needed, misplaced):
            if keys:
                when = keys[0][1].when
                self.failed.update(k for k, _ in keys)
                self.problems.append(
                    f"{', '.join(k for k, _ in keys)}: "
                    + (
                        f"missing, needed where {when[0]}={show(self.lookup(when[0]))}"
                        if keys is needed
                        else f"set, but settings only where {when[0]} is {' or '.join(when[1])}, "
                        f"not {when[0]}={show(self.lookup(when[0]))}"
                    )
                )

    def mapping(self, key: str, value, spec: MapOf) -> None:
        if value is None and spec.null:
            return
        if not isinstance(value, dict):
            return self.bad(key, value, f"must be {spec}")
        for name, v in value.items():
            if spec.keys is not None and name not in spec.keys:
                self.bad(_join(key, name), v, f"no such setting; keys of {key}: {', '.join(spec.keys)}")
            else:
                self.value(_join(key, name), v, spec.value)

    def items(self, key: str, value, spec: ListOf) -> None:
        if value is None and spec.null:
            return
        if (
            not isinstance(value, (list, tuple))
            or len(value) < spec.min_length
            or (spec.length is not None and len(value) != spec.length)
        ):
            return self.bad(key, value, f"must be {spec}")
        for i, v in enumerate(value):
            self.value(f"{key}[{i}]", v, spec.item)


def setting(spec: Spec, doc: str, default: Any = REQUIRED) -> Any:
    """A typed config's field: what it accepts, what it is for, its default (a list or mapping is
    copied for each instance)."""
    meta = {"spec": spec, "doc": doc}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, doc: str, **spec: Any) -> Any:
    """A typed config's field holding another typed config (a Section: `null`, `optional`, `when`)."""
    return field(default_factory=cls, metadata={"section": cls, "doc": doc, "spec": spec})


def fields_of(cls: type) -> dict[str, Spec]:
    """A typed config's fields as Specs, each with its description and default; a nested one as a
    Section holding its own."""
    out: dict[str, Spec] = {}
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            nested = fields_of(f.metadata["section"])
            out[f.name] = Section(doc=f.metadata["doc"], fields=nested, **f.metadata["spec"])
        elif "spec" in f.metadata:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            out[f.name] = dataclasses.replace(f.metadata["spec"], doc=f.metadata["doc"], default=default)
    return out


def flat_keys(fields: dict[str, Spec], prefix: str = "") -> dict[str, Spec]:
    """Nested Specs as dotted keys, a nested section before its fields (empty in the flat table: its
    keys follow it)."""
    out: dict[str, Spec] = {}
    for name, spec in fields.items():
        key = _join(prefix, name)
        if isinstance(spec, Section):
            if prefix:  # a top-level name is a group, not a key
                out[key] = dataclasses.replace(spec, fields={})
            out.update(flat_keys(spec.fields, key))
        else:
            out[key] = spec
    return out


def check_fields(config: Any, prefix: str) -> list[str]:
    """The problems of a typed config's own values, as the schema words them (`key=value: ...`)."""
    found = Checker({}, {})
    for name, spec in fields_of(type(config)).items():
        found.value(_join(prefix, name), getattr(config, name), spec)
    return found.problems
