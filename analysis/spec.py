"""A study as data: experiments/<study>/study.yaml, its pre-registration. The arms (Hydra overrides),
the phases and their seeds, the rule that sets the judging seeds, the families of comparisons the
verdicts come from, and the reduced pipeline CI runs. Loaded and checked here, every problem at once
(SpecError: the key, what is wrong, the fix) before anything runs: the types and ranges by pydantic,
what the keys name (arms, phases, families) by `_references`. `fldp-study` (analysis.study) runs and
reports it; docs/studies.md shows a whole spec."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any, Literal, get_type_hints

import yaml
from pydantic import ConfigDict, Field, StrictBool, StrictInt, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

TESTS = ("judge", "explore")  # analysis.stats: a family's verdicts, or comparisons shown and not judged
PAPER_SIDES = ("paper", "above", "below")  # the paper's own ratio, or only the claim's side of 1
METRICS = ("eval_perplexity", "train_time_s")  # a family's ratios: of a run's final eval perplexity, or its time
STRICT = ConfigDict(extra="forbid", coerce_numbers_to_str=True)  # an override `seed=3` read as 3 is "3"
Seeds = Annotated[tuple[StrictInt, ...], Field(min_length=1)]
Positive = Annotated[float, Field(gt=0)]


class SpecError(Exception):
    """What is wrong with a spec: one line per problem."""


@dataclass(frozen=True, config=STRICT)
class Comparison:
    """Claim: num's metric / den's, over paired seeds; `paper`: the paper's value of the ratio of
    the two arms' algorithms, or "above"/"below" (no value: only the side the claim is on). `also`:
    an algorithm the numerator stands for too (HSDP is FSDP's computation in the simulator), whose
    paper value the same interval is read against (size only)."""

    claim: str
    num: str
    den: str
    paper: Literal["paper", "above", "below"] = "paper"
    also: str | None = None


@dataclass(frozen=True, config=STRICT)
class Family:
    """`phases` (in YAML `phase`: one, or a list): where its arms' runs are looked for (several where
    its arms belong to different phases: each arm's runs are in one of them). `note`: what the report
    says above the family's table (e.g. why it is explored only). `metric`: the run's number each
    ratio is of (the tiny study's time claims: train_time_s)."""

    name: str
    phases: Annotated[tuple[str, ...], Field(min_length=1)]
    test: Literal["judge", "explore"]
    comparisons: Annotated[tuple[Comparison, ...], Field(min_length=1)]
    note: str = ""
    metric: Literal["eval_perplexity", "train_time_s"] = "eval_perplexity"

    @property
    def phase(self) -> str:
        return self.phases[0]


@dataclass(frozen=True, config=STRICT)
class Phase:
    """`seeds`: fixed; or None: as many as `seed_rule` decides (each arm from 0). `arms`: all the
    spec's where not given. `overrides`: for this phase's runs only. `run: false`: a phase whose runs
    are kept and reported but never made again (an amended plan's earlier runs)."""

    name: str
    arms: tuple[str, ...]
    seeds: Seeds | None = None
    overrides: tuple[str, ...] = ()
    run: StrictBool = True


@dataclass(frozen=True, config=STRICT)
class SeedRule:
    """The judging seeds from a pilot: the least n giving every ratio of `family` a half-width of
    at most `half_width` at the pilot's paired SDs, within [min, max]; with `budget_s`, capped so one
    seed of every arm times n fits it, and a cap under `min` gives `fallback_arms` `fallback_seeds`
    and the others what the budget has left (at least `fallback_seeds`)."""

    phase: str
    family: str
    half_width: Positive
    min: Annotated[StrictInt, Field(ge=2)]
    max: StrictInt | None = None
    budget_s: Positive | None = None
    fallback_seeds: StrictInt | None = None
    fallback_arms: tuple[str, ...] = ()


@dataclass(frozen=True, config=STRICT)
class Beside:
    """`family`'s rows beside another study's committed primary verdicts, claim by claim: in order,
    or `rows[i]` the other study's row beside the family's i-th comparison."""

    family: str
    study: str
    label: str
    rows: tuple[Annotated[StrictInt, Field(ge=0)], ...] = ()


# named pieces of a report a spec can ask for (analysis.pieces), each with the arguments it takes
PIECES = {
    "noise_scale": (),
    "reruns": ("phase", "of", "metric"),
    "identical": ("phase", "to"),
    "slope": ("phases", "rungs", "primary", "secondary", "at"),
    "best_lr": ("phases", "family"),  # the tiny study's (analysis.science_pieces)
    "by_lr": ("families",),
    "drift": ("pairs",),
    "batch_control": ("controls",),
    "frontier": ("phases",),
    "tables34": ("phase",),
}


@dataclass(frozen=True, config=STRICT)
class Piece:
    """In YAML its name, or a mapping {name: {its arguments}}."""

    name: str
    args: dict = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, config=STRICT)
class Tune:
    """Each tuned arm's value of `key`, chosen from its runs in `phases` (in YAML `phase`: one, or
    several where the arms are tuned at different times: the model-size ladder, a rung at a time),
    where they sweep `grid` over the phase's seeds: the value with the lowest geometric-mean metric;
    where that is at an edge of the grid, one more value past it (times or over `step`, to 3 digits)
    is run, once. An arm's override `KEY=@ARM` takes ARM's chosen value (the paper-shape study: every
    arm's lr, and FSDP's as the shared one)."""

    phases: tuple[str, ...]
    key: str
    grid: Annotated[tuple[Positive, ...], Field(min_length=2)]
    step: Positive | None = None


@dataclass(frozen=True, config=STRICT)
class Reduced:
    """CI's pipeline check: more overrides, fewer seeds: a phase's from `seeds` where it names the
    phase, else 0..judging_seeds-1; `grid`: the tune phase's, where given; `until`: the last phase it
    runs (the model-size ladder's: its two small rungs), else every one."""

    judging_seeds: StrictInt
    overrides: tuple[str, ...] = ()
    seeds: dict[str, Seeds] = dataclasses.field(default_factory=dict)
    grid: tuple[Positive, ...] = ()
    until: str | None = None


@dataclass(frozen=True, config=STRICT)
class Study:
    name: Annotated[str, Field(min_length=1)]
    title: Annotated[str, Field(min_length=1)]
    directory: Path
    train: tuple[str, ...]
    arms: Annotated[dict[str, tuple[str, ...]], Field(min_length=1)]
    phases: Annotated[tuple[Phase, ...], Field(min_length=1)]
    families: Annotated[tuple[Family, ...], Field(min_length=1)]
    target: Annotated[float, Field(gt=0, lt=1)]
    reduced: Reduced
    seed_rule: SeedRule | None = None
    beside: tuple[Beside, ...] = ()
    pieces: tuple[Piece, ...] = ()
    tune: Tune | None = None
    sha256: str = dataclasses.field(default="", compare=False)

    @property
    def plan(self) -> Path:
        return self.directory / "PLAN.md"

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)


def load(path: str | Path) -> Study:
    """The spec at `path` (a study.yaml, or the directory holding one), checked."""
    path = Path(path)
    if path.is_dir():
        path = path / "study.yaml"
    if not path.is_file():
        raise SpecError(f"{path}: no such spec (a study.yaml, or the directory holding one)")
    raw = path.read_bytes()
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not YAML ({e})") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: the spec is not a mapping of keys (name, arms, phases, families, ...)")
    problems = [f"unknown key '{k}' (the keys: {', '.join(KEYS)})" for k in sorted(set(data) - set(KEYS))]
    parts, found = _typed(_as_fields(data), data)
    problems += found + _references(SimpleNamespace(**{**DEFAULTS, **parts}), data)
    if problems:
        raise SpecError("\n".join(f"{path}: {p}" for p in dict.fromkeys(problems)))
    return Study(**parts, directory=path.parent.resolve(), sha256=hashlib.sha256(raw).hexdigest())


KEYS: tuple[str, ...] = ("name", "title", "train", "arms", "phases", "families", "target", "reduced")
KEYS += ("seed_rule", "beside", "pieces", "tune")
# the fix each key's wrong value asks for, by its name (the last name in its path)
HINTS = {
    "seeds": "a list of integer seeds, or absent (the seed rule decides)",
    "test": f"one of {', '.join(TESTS)}",
    "paper": f"one of {', '.join(PAPER_SIDES)}",
    "metric": f"one of {', '.join(METRICS)}",
    "comparisons": "a family of zero; list at least one {claim, num, den} (arm names)",
    "target": "the half-width a verdict's interval should meet, e.g. 0.02 (+-2%)",
    "run": "true or false (false: its runs are kept, never made again)",
    "grid": "at least two positive numbers",
    "min": "an integer >= 2",
    "half_width": "a positive number, e.g. 0.018",
    "rows": "the other study's row (from 0) beside each comparison",
    "judging_seeds": "an integer: the judging seeds of CI's pipeline check",
    "arms": "a mapping of each arm to its Hydra overrides, e.g. `fsdp: [algorithm=fsdp]`",
    "name": "a string (name: the study's short name, as in outputs/NAME)",
    "phases": "a mapping with a name (and seeds, arms, overrides, run)",
    "families": "a mapping with a name, a phase, a test and comparisons",
    "beside": "a mapping of family, study and label (and rows)",
    "pieces": f"one of {', '.join(PIECES)}, e.g. `- reruns: {{phase: P, of: STUDY, metric: eval_loss}}`",
}


# each key's type: validated one key (and one list entry) at a time, so one bad entry hides nothing
PARTS = {k: t for k, t in get_type_hints(Study, include_extras=True).items() if k in KEYS}
ITEMS = {"phases": Phase, "families": Family, "beside": Beside, "pieces": Piece}
REQUIRED = ("name", "title", "arms", "phases", "families", "target", "reduced")
DEFAULTS: dict[str, Any] = {**dict.fromkeys(ITEMS, ()), "arms": {}, "seed_rule": None, "reduced": None, "tune": None}


@functools.cache
def _adapter(kind) -> TypeAdapter:
    return TypeAdapter(kind) if dataclasses.is_dataclass(kind) else TypeAdapter(kind, config=STRICT)


def _typed(d: dict, raw: dict) -> tuple[dict, list[str]]:
    """The spec's values typed (`d`: _as_fields of `raw`), and the problems, each as the spec names it."""
    parts, problems = {}, []
    for key, kind in {**PARTS, **ITEMS}.items():  # ITEMS' types for the entries of its keys
        if d.get(key) is None:
            problems += [f"{key}: missing; {HINTS.get(key, 'required')}"] * (key in REQUIRED)
            continue
        if key not in ITEMS:
            try:
                parts[key] = _adapter(kind).validate_python(d[key])
            except ValidationError as e:
                problems += [_problem(err, raw, (key,)) for err in e.errors()]
            continue
        if not isinstance(d[key], list) or not d[key] and key in REQUIRED:
            problems.append(f"{key}: a list of at least one entry, not {d[key]!r}")
            continue
        parts[key] = []
        for i, item in enumerate(d[key]):
            try:
                parts[key].append(_adapter(kind).validate_python(item))
            except ValidationError as e:
                problems += [_problem(err, raw, (key, i)) for err in e.errors()]
    return {k: tuple(v) if k in ITEMS else v for k, v in parts.items()}, problems


def _as_fields(d: dict) -> dict:
    """The YAML's shorthands as the dataclasses' fields: a family's or the tune block's `phase` (one
    or a list) as `phases`, a phase's absent `arms` as every arm, a family's absent `test` as judge,
    a piece's name or {name: args}."""
    out = {k: v for k, v in d.items() if k in KEYS}
    arms = list(d["arms"]) if isinstance(d.get("arms"), dict) else []
    if isinstance(d.get("phases"), list):
        out["phases"] = [{"arms": arms, **p} if isinstance(p, dict) else p for p in d["phases"]]
    if isinstance(d.get("families"), list):
        out["families"] = [_phases({"test": "judge", **f} if isinstance(f, dict) else f) for f in d["families"]]
    if isinstance(d.get("tune"), dict):
        out["tune"] = _phases(d["tune"])
    if isinstance(d.get("pieces"), list):
        out["pieces"] = [_piece(p) for p in d["pieces"]]
    return out


def _phases(d):
    if not isinstance(d, dict) or "phase" not in d:
        return d
    phases = d["phase"] if isinstance(d["phase"], list) else [d["phase"]]
    return {**{k: v for k, v in d.items() if k != "phase"}, "phases": phases}


def _piece(p):
    if isinstance(p, str):
        return {"name": p}
    if isinstance(p, dict) and len(p) == 1:
        name, args = next(iter(p.items()))
        return {"name": name, "args": args}
    return p


def _problem(err: Any, data: dict, at: tuple) -> str:
    """A pydantic error as `KEY: VALUE; THE FIX`, the key as the spec names it (`phases.pilot.seeds`,
    `families.primary.comparisons[0].paper`; `at`: where the validated value is in the spec)."""
    names: list[str] = []
    node: Any = data
    value: Any = data
    for i, part in enumerate((*at, *err["loc"])):
        if isinstance(part, str):
            part = "phase" if part == "phases" and isinstance(node, dict) and "phase" in node else part
            names.append(part)
            node = value = node.get(part) if isinstance(node, dict) else None
        elif isinstance(node, list) and part < len(node) and (i < len(at) or isinstance(node[part], dict)):
            item = node[part]  # an entry: named by its name, else its index; a scalar's list is the value
            names[-1] += (
                f".{item['name']}" if isinstance(item, dict) and isinstance(item.get("name"), str) else f"[{part}]"
            )
            node = value = item
        else:
            break
    key = ".".join(names)
    if err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
        return f"{key.rpartition('.')[0]}: unknown key '{names[-1]}'"
    hint = HINTS.get(names[-1].split(".")[0].split("[")[0], err["msg"])
    return f"{key}: missing; {hint}" if err["type"] == "missing" else f"{key}: {value!r}; {hint}"


def _references(study, raw: dict) -> list[str]:
    """What the keys name must be the spec's own: arms, phases, families, named as the spec names
    them (`raw`), so that an entry with a problem of its own adds no other; `study`: what is valid."""
    arms = raw["arms"] if isinstance(raw.get("arms"), dict) else None  # None: not checked
    phases, named = _names(raw, "phases"), _names(raw, "families")
    families = {f.name: f for f in study.families}
    problems = [
        f"arms.{a}: '{o}' is not a Hydra override KEY=VALUE"
        for a, own in study.arms.items()
        for o in own
        if "=" not in o
    ]
    for p in study.phases:
        problems += _unknown(p.arms, arms, f"phases.{p.name}.arms", NO_ARM)
    for f in study.families:
        problems += _unknown(f.phases, phases, f"families.{f.name}.phase", NO_PHASE)
        for j, c in enumerate(f.comparisons):
            problems += _unknown([c.num, c.den], arms, f"families.{f.name}.comparisons[{j}]", NO_ARM)
    rule = study.seed_rule
    if rule is not None:
        problems += _unknown([rule.phase], phases, "seed_rule.phase", NO_PHASE)
        problems += _unknown([rule.family], named, "seed_rule.family", NO_FAMILY)
        problems += _unknown(rule.fallback_arms, arms, "seed_rule.fallback_arms", NO_ARM)
    elif "seed_rule" not in raw and any(p.seeds is None for p in study.phases):
        problems.append("phases: a phase without seeds needs seed_rule, which decides them")
    if study.reduced is not None:
        problems += _unknown(study.reduced.seeds, phases, "reduced.seeds", NO_PHASE)
        problems += _unknown([study.reduced.until] if study.reduced.until else [], phases, "reduced.until", NO_PHASE)
    for b in study.beside:
        family = families.get(b.family)
        problems += _unknown([b.family], named, "beside.family", NO_FAMILY)
        if family is not None and b.rows and len(b.rows) != len(family.comparisons):
            problems.append(
                f"beside.rows: {len(b.rows)} rows for family {b.family}'s {len(family.comparisons)} comparisons"
            )
    for piece in study.pieces:
        problems += _piece_problems(piece, arms, named, phases)
    return problems + _tune_problems(study, phases)


def _names(raw: dict, key: str) -> list[str] | None:
    """The names of a list's entries, as the spec writes them; None (not checked) if not a list."""
    if not isinstance(raw.get(key), list):
        return None
    return [e["name"] for e in raw[key] if isinstance(e, dict) and isinstance(e.get("name"), str)]


def _unknown(names, known, key: str, refusal: str) -> list[str]:
    """`KEY: REFUSAL` for each name not among `known` (None: not checked); REFUSAL is formatted with
    the name ({0}) and the known names ({1})."""
    if known is None:
        return []
    return [f"{key}: " + refusal.format(n, ", ".join(known)) for n in names if n not in known]


NO_ARM = "no arm '{0}' (the arms: {1}); add it under arms or fix the name"
NO_PHASE = "{0!r} is not a phase (the phases: {1})"
NO_FAMILY = "{0!r} is not a family ({1})"


def _tune_problems(study, phases: list[str] | None) -> list[str]:
    """The tune block's phases, and every `KEY=@ARM` override naming its key and a tuned arm."""
    uses = [(a, o) for a, own in study.arms.items() for o in own if "=@" in o]
    t = study.tune
    if t is None:
        return [f"arms.{a}: '{o}' takes a tuned value, but the spec has no tune block" for a, o in uses]
    problems = _unknown(t.phases, phases, "tune.phase", NO_PHASE)
    tuned = {a for p in study.phases if p.name in t.phases for a in p.arms}
    for a, o in uses:
        key, _, of = o.partition("=@")
        if key != t.key or of not in tuned:
            problems.append(f"arms.{a}: '{o}': a tuned value is `{t.key}=@ARM`, ARM an arm of the tune phase")
    return problems


def _piece_problems(piece: Piece, arms: dict | None, families: list[str] | None, phases: list[str] | None) -> list[str]:
    """A piece's name and arguments, and the arms, families and phases they name."""
    name, args = piece.name, piece.args
    if name not in PIECES:
        return [
            f"pieces: {name!r}; one of {', '.join(PIECES)}, e.g. `- reruns: {{phase: P, of: STUDY, metric: eval_loss}}`"
        ]
    if set(args) != set(PIECES[name]):
        wanted = ", ".join(PIECES[name]) or "none"
        return [f"pieces.{name}: arguments {', '.join(sorted(args)) or 'none'}; it takes {wanted}"]
    problems = _unknown([args["phase"]] if "phase" in args else [], phases, f"pieces.{name}.phase", NO_PHASE)
    problems += _unknown(args.get("phases") or [], phases, f"pieces.{name}.phases", NO_PHASE)
    named = [*([args["family"]] if "family" in args else []), *(args.get("families") or [])]
    problems += _unknown(named, families, f"pieces.{name}", NO_FAMILY)
    listed = [*(args.get("pairs") or []), *(args.get("controls") or [])]
    if not all(isinstance(x, list) for x in listed):
        return [*problems, f"pieces.{name}: lists of arms, e.g. [[hsdp, fsdp]]"]
    problems += _unknown([a for x in listed for a in (x[:2] if name == "drift" else x)], arms, f"pieces.{name}", NO_ARM)
    return problems + (_slope_problems(args, arms) if name == "slope" else [])


def _slope_problems(args: dict, arms: dict | None) -> list[str]:
    """The slope piece's arms are NUM-RUNG and DEN-RUNG for each pair and rung: each must be an arm."""
    pairs = [*(args.get("primary") or []), *(args.get("secondary") or [])]
    if not pairs or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        return ["pieces.slope: primary and secondary are lists of [NUM, DEN] pairs, e.g. [[fsdp, fl_hsdp]]"]
    problems = []
    if not isinstance(args.get("at"), (int, float)) or args["at"] <= 0:
        problems.append(f"pieces.slope.at: {args.get('at')!r}; the parameter count to carry each line to")
    wanted = dict.fromkeys(f"{a}-{rung}" for rung in args.get("rungs") or [] for pair in pairs for a in pair)
    return problems + _unknown(wanted, arms, "pieces.slope (ARM-RUNG)", NO_ARM)
