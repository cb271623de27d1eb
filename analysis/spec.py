"""A study as data: experiments/<study>/study.yaml, its pre-registration. The arms (Hydra overrides),
the phases and their seeds, the rule that sets the judging seeds, the families of comparisons the
verdicts come from, and the reduced pipeline CI runs. Loaded and checked here, every problem at once
(SpecError: the key, what is wrong, the fix) before anything runs. `fldp-study` (analysis.study)
runs and reports it; docs/studies.md shows a whole spec."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import yaml

TESTS = ("judge", "explore")  # analysis.stats: a family's verdicts, or comparisons shown and not judged
PAPER_SIDES = ("paper", "above", "below")  # the paper's own ratio, or only the claim's side of 1
METRICS = ("eval_perplexity", "train_time_s")  # a family's ratios: of a run's final eval perplexity, or its time


class SpecError(Exception):
    """What is wrong with a spec: one line per problem."""


@dataclass(frozen=True)
class Comparison:
    """Claim: num's metric / den's, over paired seeds; `paper`: the paper's value of the ratio of
    the two arms' algorithms, or "above"/"below" (no value: only the side the claim is on). `also`:
    an algorithm the numerator stands for too (HSDP is FSDP's computation in the simulator), whose
    paper value the same interval is read against (size only)."""

    claim: str
    num: str
    den: str
    paper: str = "paper"
    also: str | None = None


@dataclass(frozen=True)
class Family:
    """`phases`: where its arms' runs are looked for (one, or several where its arms belong to
    different phases: each arm's runs are in one of them). `note`: what the report says above the
    family's table (e.g. why it is explored only). `metric`: the run's number each ratio is of
    (the tiny study's time claims: train_time_s)."""

    name: str
    phases: tuple[str, ...]
    test: str
    comparisons: tuple[Comparison, ...]
    note: str = ""
    metric: str = "eval_perplexity"

    @property
    def phase(self) -> str:
        return self.phases[0]


@dataclass(frozen=True)
class Phase:
    """`seeds`: fixed; or None: as many as `seed_rule` decides (each arm from 0). `overrides`: for
    this phase's runs only. `run: false`: a phase whose runs are kept and reported but never made
    again (an amended plan's earlier runs)."""

    name: str
    arms: tuple[str, ...]
    seeds: tuple[int, ...] | None
    overrides: tuple[str, ...] = ()
    run: bool = True


@dataclass(frozen=True)
class SeedRule:
    """The judging seeds from a pilot: the least n giving every ratio of `family` a half-width of
    at most `half_width` at the pilot's paired SDs, within [min, max]; with `budget_s`, capped so one
    seed of every arm times n fits it, and a cap under `min` gives `fallback_arms` `fallback_seeds`
    and the others what the budget has left (at least `fallback_seeds`)."""

    phase: str
    family: str
    half_width: float
    min: int
    max: int | None = None
    budget_s: float | None = None
    fallback_seeds: int | None = None
    fallback_arms: tuple[str, ...] = ()


@dataclass(frozen=True)
class Beside:
    """`family`'s rows beside another study's committed primary verdicts, claim by claim: in order,
    or `rows[i]` the other study's row beside the family's i-th comparison."""

    family: str
    study: str
    label: str
    rows: tuple[int, ...] = ()


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


@dataclass(frozen=True)
class Piece:
    name: str
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Tune:
    """Each tuned arm's value of `key`, chosen from its runs in `phases` (one, or several where the
    arms are tuned at different times: the model-size ladder, a rung at a time), where they sweep
    `grid` over the phase's seeds: the value with the lowest geometric-mean metric; where that is at
    an edge of the grid, one more value past it (times or over `step`, to 3 digits) is run, once. An
    arm's override `KEY=@ARM` takes ARM's chosen value (the paper-shape study: every arm's lr, and
    FSDP's as the shared one)."""

    phases: tuple[str, ...]
    key: str
    grid: tuple[float, ...]
    step: float | None = None


@dataclass(frozen=True)
class Reduced:
    """CI's pipeline check: more overrides, fewer seeds: a phase's from `seeds` where it names the
    phase, else 0..judging_seeds-1; `grid`: the tune phase's, where given; `until`: the last phase it
    runs (the model-size ladder's: its two small rungs), else every one."""

    overrides: tuple[str, ...]
    seeds: dict[str, tuple[int, ...]]
    judging_seeds: int
    grid: tuple[float, ...] = ()
    until: str | None = None


@dataclass(frozen=True)
class Study:
    name: str
    title: str
    directory: Path
    train: tuple[str, ...]
    arms: dict[str, tuple[str, ...]]
    phases: tuple[Phase, ...]
    families: tuple[Family, ...]
    target: float
    reduced: Reduced
    seed_rule: SeedRule | None = None
    beside: tuple[Beside, ...] = ()
    pieces: tuple[Piece, ...] = ()
    tune: Tune | None = None
    sha256: str = field(default="", compare=False)

    @property
    def plan(self) -> Path:
        return self.directory / "PLAN.md"

    @property
    def results(self) -> Path:
        """The committed report."""
        return self.directory / "results"

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
    problems: list[str] = []
    study = _build(data if isinstance(data, dict) else {}, path.parent.resolve(), problems)
    if not isinstance(data, dict):
        problems.insert(0, "the spec is not a mapping of keys (name, arms, phases, families, ...)")
    if problems:
        raise SpecError("\n".join(f"{path}: {p}" for p in problems))
    assert study is not None
    return Study(**{**study.__dict__, "sha256": hashlib.sha256(raw).hexdigest()})


KEYS = {
    *("name", "title", "train", "arms", "phases", "families", "target", "reduced", "seed_rule", "beside"),
    *("pieces", "tune"),
}


def _build(d: dict, directory: Path, problems: list[str]) -> Study | None:
    for key in sorted(set(d) - KEYS):
        problems.append(f"unknown key '{key}' (the keys: {', '.join(sorted(KEYS))})")
    arms = {str(k): tuple(_strings(v, f"arms.{k}", problems)) for k, v in _mapping(d, "arms", problems).items()}
    for name, overrides in arms.items():
        for o in overrides:
            if "=" not in o:
                problems.append(f"arms.{name}: '{o}' is not a Hydra override KEY=VALUE")
    if not arms:
        problems.append("arms: none; name each arm and its overrides, e.g. `fsdp: [algorithm=fsdp]`")
    phases = tuple(_phase(p, i, arms, problems) for i, p in enumerate(_list(d, "phases", problems)))
    names = [p.name for p in phases]
    families = tuple(_family(f, i, arms, names, problems) for i, f in enumerate(_list(d, "families", problems)))
    rule = _seed_rule(d.get("seed_rule"), arms, names, [f.name for f in families], problems)
    if rule is None and any(p.seeds is None for p in phases):
        problems.append("phases: a phase without seeds needs seed_rule, which decides them")
    reduced = _reduced(d.get("reduced"), names, problems)
    beside = tuple(_beside(b, families, problems) for b in _list(d, "beside", problems, True))
    pieces = tuple(_piece(p, names, problems) for p in _list(d, "pieces", problems, True))
    for piece in (p for p in pieces if p.name == "slope"):
        _slope(piece.args, arms, names, problems)
    for piece in pieces:
        _named(piece, arms, [f.name for f in families], names, problems)
    tune = _tune(d.get("tune"), arms, phases, problems)
    target = d.get("target")
    if not isinstance(target, (int, float)) or not 0 < target < 1:
        problems.append(f"target: {target!r}; the half-width a verdict's interval should meet, e.g. 0.02 (+-2%)")
    for key in ("name", "title"):
        if not isinstance(d.get(key), str) or not d.get(key):
            problems.append(f"{key}: missing; a string (name: the study's short name, as in outputs/NAME)")
    train = tuple(_strings(d.get("train", []), "train", problems))
    if problems:
        return None
    return Study(
        d["name"],
        d["title"],
        directory,
        train,
        arms,
        phases,
        families,
        float(d["target"]),
        reduced,
        rule,
        beside,
        pieces,
        tune,
    )


def _mapping(d: dict, key: str, problems: list[str]) -> dict:
    v = d.get(key, {})
    if not isinstance(v, dict):
        problems.append(f"{key}: a mapping, not {type(v).__name__}")
        return {}
    return v


def _list(d: dict, key: str, problems: list[str], optional: bool = False) -> list:
    v = d.get(key, [] if optional else None)
    if not isinstance(v, list) or (not v and not optional):
        problems.append(f"{key}: a list of at least one entry, not {v!r}")
        return []
    return v


def _strings(v, key: str, problems: list[str]) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, (str, int, float)) for x in v):
        problems.append(f"{key}: a list of strings, not {v!r}")
        return []
    return [str(x) for x in v]


def _seeds(v, key: str, problems: list[str]) -> tuple[int, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or not v or not all(isinstance(s, int) and not isinstance(s, bool) for s in v):
        problems.append(f"{key}: a list of integer seeds, or absent (the seed rule decides)")
        return ()
    return tuple(v)


def _unknown_arms(names, arms: dict, key: str, problems: list[str]) -> None:
    for a in names:
        if a not in arms:
            problems.append(f"{key}: no arm '{a}' (the arms: {', '.join(arms)}); add it under arms or fix the name")


def _phase(p, i: int, arms: dict, problems: list[str]) -> Phase:
    key = f"phases[{i}]"
    if not isinstance(p, dict) or not isinstance(p.get("name"), str):
        problems.append(f"{key}: a mapping with a name (and seeds, arms)")
        return Phase(f"?{i}", (), ())
    key = f"phases.{p['name']}"
    for extra in sorted(set(p) - {"name", "arms", "seeds", "overrides", "run"}):
        problems.append(f"{key}: unknown key '{extra}' (a phase's keys: name, arms, seeds, overrides, run)")
    names = tuple(_strings(p.get("arms", list(arms)), f"{key}.arms", problems))
    _unknown_arms(names, arms, f"{key}.arms", problems)
    if not isinstance(p.get("run", True), bool):
        problems.append(f"{key}.run: true or false (false: its runs are kept, never made again)")
    overrides = tuple(_strings(p.get("overrides", []), f"{key}.overrides", problems))
    return Phase(p["name"], names, _seeds(p.get("seeds"), f"{key}.seeds", problems), overrides, p.get("run", True))


def _family(f, i: int, arms: dict, phases: list[str], problems: list[str]) -> Family:
    key = f"families[{i}]"
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        problems.append(f"{key}: a mapping with a name, a phase, a test and comparisons")
        return Family(f"?{i}", ("",), "judge", ())
    key = f"families.{f['name']}"
    own = tuple(f["phase"]) if isinstance(f.get("phase"), list) and f["phase"] else (f.get("phase"),)
    for phase in own:
        if phase not in phases:
            problems.append(f"{key}.phase: {phase!r} is not a phase (the phases: {', '.join(phases)})")
    if f.get("test", "judge") not in TESTS:
        problems.append(f"{key}.test: {f.get('test')!r}; one of {', '.join(TESTS)}")
    comparisons = []
    raw = f.get("comparisons")
    if not isinstance(raw, list) or not raw:
        problems.append(f"{key}.comparisons: a family of zero; list at least one {{claim, num, den}}")
        raw = []
    for j, c in enumerate(raw):
        if not isinstance(c, dict) or not all(isinstance(c.get(k), str) for k in ("claim", "num", "den")):
            problems.append(f"{key}.comparisons[{j}]: a mapping with claim, num and den (arm names)")
            continue
        _unknown_arms([c["num"], c["den"]], arms, f"{key}.comparisons[{j}]", problems)
        if c.get("paper", "paper") not in PAPER_SIDES:
            problems.append(f"{key}.comparisons[{j}].paper: {c.get('paper')!r}; one of {', '.join(PAPER_SIDES)}")
        comparisons.append(Comparison(c["claim"], c["num"], c["den"], c.get("paper", "paper"), c.get("also")))
    metric = f.get("metric", "eval_perplexity")
    if metric not in METRICS:
        problems.append(f"{key}.metric: {metric!r}; one of {', '.join(METRICS)}")
    note = str(f.get("note", ""))
    return Family(f["name"], tuple(map(str, own)), f.get("test", "judge"), tuple(comparisons), note, str(metric))


def _seed_rule(r, arms: dict, phases: list[str], families: list[str], problems: list[str]) -> SeedRule | None:
    if r is None:
        return None
    fields_ = set(SeedRule.__dataclass_fields__)
    if not isinstance(r, dict) or set(r) - fields_:
        problems.append(f"seed_rule: a mapping of {', '.join(sorted(fields_))}")
        return None
    if r.get("phase") not in phases:
        problems.append(f"seed_rule.phase: {r.get('phase')!r} is not a phase (the phases: {', '.join(phases)})")
    if r.get("family") not in families:
        problems.append(f"seed_rule.family: {r.get('family')!r} is not a family ({', '.join(families)})")
    if not isinstance(r.get("min"), int) or r["min"] < 2 or not isinstance(r.get("half_width"), (int, float)):
        problems.append("seed_rule: min (an integer >= 2) and half_width (e.g. 0.018) are required")
    _unknown_arms(r.get("fallback_arms", []), arms, "seed_rule.fallback_arms", problems)
    return SeedRule(**{**r, "fallback_arms": tuple(r.get("fallback_arms", []))})


def _reduced(r, phases: list[str], problems: list[str]) -> Reduced:
    if not isinstance(r, dict) or not isinstance(r.get("judging_seeds"), int):
        problems.append("reduced: a mapping with overrides, seeds (per phase) and judging_seeds (CI's pipeline check)")
        return Reduced((), {}, 0)
    seeds = {}
    for phase, v in (r.get("seeds") or {}).items():
        if phase not in phases:
            problems.append(f"reduced.seeds.{phase}: not a phase (the phases: {', '.join(phases)})")
        seeds[phase] = _seeds(v, f"reduced.seeds.{phase}", problems) or ()
    grid = tuple(r.get("grid") or ())
    if not all(isinstance(v, (int, float)) and v > 0 for v in grid):
        problems.append(f"reduced.grid: {list(grid)!r}; positive numbers")
    overrides = tuple(_strings(r.get("overrides", []), "reduced.overrides", problems))
    if r.get("until") is not None and r["until"] not in phases:
        problems.append(f"reduced.until: {r['until']!r} is not a phase (the phases: {', '.join(phases)})")
    return Reduced(overrides, seeds, r["judging_seeds"], tuple(float(v) for v in grid), r.get("until"))


def _tune(t, arms: dict, phases: tuple[Phase, ...], problems: list[str]) -> Tune | None:
    """The tune block, and every `KEY=@ARM` override naming its key and a tuned arm."""
    uses = [(a, o) for a, own in arms.items() for o in own if "=@" in o]
    if t is None:
        for a, o in uses:
            problems.append(f"arms.{a}: '{o}' takes a tuned value, but the spec has no tune block")
        return None
    if not isinstance(t, dict) or set(t) - {"phase", "key", "grid", "step"}:
        problems.append("tune: a mapping of phase, key, grid (and step)")
        return None
    names = tuple(t["phase"]) if isinstance(t.get("phase"), list) else (t.get("phase"),)
    own = [p for p in phases if p.name in names]
    for name in names:
        if name not in [p.name for p in phases]:
            problems.append(f"tune.phase: {name!r} is not a phase ({', '.join(p.name for p in phases)})")
    grid = t.get("grid")
    if not isinstance(grid, list) or len(grid) < 2 or not all(isinstance(v, (int, float)) and v > 0 for v in grid):
        problems.append(f"tune.grid: {grid!r}; at least two positive numbers")
        grid = []
    tuned = {a for p in own for a in p.arms}
    for a, o in uses:
        key, _, of = o.partition("=@")
        if key != t.get("key") or of not in tuned:
            problems.append(f"arms.{a}: '{o}': a tuned value is `{t.get('key')}=@ARM`, ARM an arm of the tune phase")
    return Tune(tuple(map(str, names)), str(t.get("key")), tuple(map(float, grid)), t.get("step"))


def _beside(b, families: tuple[Family, ...], problems: list[str]) -> Beside:
    if not isinstance(b, dict) or not all(isinstance(b.get(k), str) for k in ("family", "study", "label")):
        problems.append("beside: each a mapping of family, study and label (and rows)")
        return Beside("", "", "")
    family = next((f for f in families if f.name == b["family"]), None)
    if family is None:
        problems.append(f"beside.family: {b['family']!r} is not a family ({', '.join(f.name for f in families)})")
    rows = b.get("rows", [])
    if not isinstance(rows, list) or not all(isinstance(r, int) and r >= 0 for r in rows):
        problems.append(f"beside.rows: {rows!r}; the other study's row (from 0) beside each comparison")
        rows = []
    elif rows and family is not None and len(rows) != len(family.comparisons):
        problems.append(
            f"beside.rows: {len(rows)} rows for family {family.name}'s {len(family.comparisons)} comparisons"
        )
    return Beside(b["family"], b["study"], b["label"], tuple(rows))


def _piece(p, phases: list[str], problems: list[str]) -> Piece:
    """A piece: its name, or a mapping {name: {its arguments}}."""
    name, args = (
        (p, {}) if isinstance(p, str) else (next(iter(p.items())) if isinstance(p, dict) and len(p) == 1 else ("", {}))
    )
    if name not in PIECES or not isinstance(args, dict):
        problems.append(
            f"pieces: {p!r}; one of {', '.join(PIECES)}, e.g. `- reruns: {{phase: P, of: STUDY, metric: eval_loss}}`"
        )
        return Piece(str(name))
    if set(args) != set(PIECES[name]):
        wanted = ", ".join(PIECES[name]) or "none"
        problems.append(f"pieces.{name}: arguments {', '.join(sorted(args)) or 'none'}; it takes {wanted}")
    if "phase" in args and args["phase"] not in phases:
        problems.append(f"pieces.{name}.phase: {args['phase']!r} is not a phase ({', '.join(phases)})")
    return Piece(name, dict(args))


def _slope(args: dict, arms: dict, phases: list[str], problems: list[str]) -> None:
    """The slope piece's arms are NUM-RUNG and DEN-RUNG for each pair and rung: each must be an arm."""
    for phase in args.get("phases") or []:
        if phase not in phases:
            problems.append(f"pieces.slope.phases: {phase!r} is not a phase ({', '.join(phases)})")
    pairs = [*(args.get("primary") or []), *(args.get("secondary") or [])]
    if not pairs or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        problems.append("pieces.slope: primary and secondary are lists of [NUM, DEN] pairs, e.g. [[fsdp, fl_hsdp]]")
        return
    if not isinstance(args.get("at"), (int, float)) or args["at"] <= 0:
        problems.append(f"pieces.slope.at: {args.get('at')!r}; the parameter count to carry each line to")
    for rung in args.get("rungs") or []:
        wanted = dict.fromkeys(f"{a}-{rung}" for pair in pairs for a in pair)
        _unknown_arms(wanted, arms, "pieces.slope (ARM-RUNG)", problems)


def _named(piece: Piece, arms: dict, families: list[str], phases: list[str], problems: list[str]) -> None:
    """The arms, families and phases a piece's arguments name (the tiny study's pieces) must be the spec's."""
    args = piece.args
    listed = [*(args.get("pairs") or []), *(args.get("controls") or [])]
    if not all(isinstance(x, list) for x in listed):
        problems.append(f"pieces.{piece.name}: lists of arms, e.g. [[hsdp, fsdp]]")
        return
    wanted = [a for x in listed for a in (x[:2] if piece.name == "drift" else x)]
    _unknown_arms(wanted, arms, f"pieces.{piece.name}", problems)
    for name in [*([args["family"]] if "family" in args else []), *(args.get("families") or [])]:
        if name not in families:
            problems.append(f"pieces.{piece.name}: {name!r} is not a family ({', '.join(families)})")
    if piece.name in ("best_lr", "frontier"):
        for phase in args.get("phases") or []:
            if phase not in phases:
                problems.append(f"pieces.{piece.name}.phases: {phase!r} is not a phase ({', '.join(phases)})")
