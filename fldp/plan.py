"""fldp-plan: which layout to run. Every (F, R, S) the topology's ranks allow, and A from a list,
with the memory per rank (fldp/memory.py), checked against topology.memory_gb, and the predicted
step time by phase (fldp/steptime.py: compute at a sustained rate, FSDP's collectives overlapped
with it, each tier's alpha and beta, a node's NIC shared, the aggregation amortised over A), on the
topology's calibration profile (topology.profile, fldp-calibrate) or else the published figures
with Table 4's fitted efficiencies. Layouts that do not fit are dropped, saying why; the rest are
ranked by predicted seconds per step (every layout computes the same tokens per rank). Beside it,
fldp/cost.py's communication alone. The model's errors (docs/communication.md: up to 31% on Table
4's rows, up to 36% on emulated nodes) make it a shortlist to run, not a verdict.

    fldp-plan topology=leonardo_512 model=llama3_1_8b [--every 4,8,16] [--top 3] [--json]
"""

from __future__ import annotations

import itertools
import json
import sys
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from .errors import ConfigError, parsed_or_exit, tool_arguments
from .mesh import MeshShape

if TYPE_CHECKING:
    from .config import Config

BY_DIMS = {(False, False): "fsdp", (False, True): "hsdp", (True, False): "fl_fsdp", (True, True): "fl_hsdp"}


@dataclass
class Candidate:
    algorithm: str
    federation: int
    replicate: int
    shard: int
    every: int | None
    phases: dict  # predicted seconds per step by phase (fldp/steptime.py)
    communication_s: float  # per step, fldp/cost.py's 'exact' (collectives alone, no overlap)
    bytes_per_step: dict
    memory_gb: float
    fits: bool | None
    why_not: str = ""

    @property
    def step_s(self) -> float:
        return sum(self.phases.values())

    @property
    def mesh(self) -> str:
        return f"{self.federation}x{self.replicate}x{self.shard}"

    @property
    def shape(self) -> MeshShape:
        return MeshShape(self.federation, self.replicate, self.shard)


def layouts(world: int) -> list[MeshShape]:
    """Every (F, R, S) with F x R x S = world."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return [MeshShape(f, r, world // (f * r)) for f, r in itertools.product(divisors, divisors) if world % (f * r) == 0]


def compose(overrides: list[str]) -> dict[str, Config]:
    """The config of each algorithm with the user's overrides (algorithm.* keys only for the
    federated ones, which have them), checked as fldp-train checks them, typed."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from . import CONF
    from .validation import checked

    common = [o for o in overrides if not o.lstrip("+~").startswith("algorithm")]
    federated = [o for o in overrides if o.lstrip("+~").startswith("algorithm.")]
    out = {}
    with initialize_config_dir(str(CONF), version_base="1.3"):
        for name in BY_DIMS.values():
            extra = federated if name.startswith("fl_") else []
            cfg = hydra_compose("config", overrides=[f"algorithm={name}", *common, *extra])
            out[name] = checked(cfg)
    return out


def candidates(configs: dict[str, Config], everies: list[int]) -> list[Candidate]:
    """Each layout of the topology, with each A where it federates."""
    from .cost import config_shapes, leads, predict_for
    from .memory import for_shapes
    from .steptime import efficiency_for, hardware_for, phases, workload_of

    conf = configs["fsdp"]
    shapes, buffers, units = config_shapes(conf)  # from the config: building the model takes seconds
    work, hw, eff = workload_of(conf, shapes, units), hardware_for(conf.topology), efficiency_for(conf.topology)
    memories: dict = {}  # (algorithm, A, S): what a layout's memory depends on, computed once
    capacity = conf.topology.memory_gb
    out = []
    for shape in layouts(conf.topology.nodes * conf.topology.procs_per_node):
        name = BY_DIMS[(shape.federation > 1, shape.replicate > 1)]
        for every in everies if shape.federation > 1 else [None]:
            chosen = configs[name]
            if every is not None:
                chosen = replace(chosen, algorithm=replace(chosen.algorithm, every=every))
            pred = predict_for(chosen, units, shape.federation > 1, shape)
            memory = memories.get((name, every, shape.shard))
            if memory is None:
                memory = memories[(name, every, shape.shard)] = for_shapes(chosen, shapes, buffers, units, shape)
            fits = memory.peak <= capacity * 1e9 if capacity else None
            why = _why_not(memory, capacity) if capacity and not fits else ""
            out.append(
                Candidate(
                    name,
                    shape.federation,
                    shape.replicate,
                    shape.shard,
                    every,
                    phases(work, shape, every, hw, eff, leads(chosen)),
                    sum(pred.exact.values()),
                    dict(pred.bytes_per_step),
                    memory.peak / 1e9,
                    fits,
                    why,
                )
            )
    return out


def _why_not(memory, capacity: float) -> str:
    largest = sorted(memory.terms.items(), key=lambda kv: -kv[1])[:3]
    return f"{memory.peak / 1e9:.1f} GB > {capacity:g} GB (" + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in largest) + ")"


def ranked(found: list[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
    """Those that fit (or whose topology says no capacity), fastest first; those that do not."""
    fitting = sorted((c for c in found if c.fits is not False), key=lambda c: (c.step_s, c.memory_gb))
    return fitting, [c for c in found if c.fits is False]


def command(c: Candidate, overrides: list[str]) -> str:
    """The Hydra multirun that runs a layout over three seeds."""
    every = [f"algorithm.every={c.every}"] if c.every is not None else []
    mesh = [f"mesh.federation={c.federation}", f"mesh.replicate={c.replicate}", f"mesh.shard={c.shard}"]
    rest = [o for o in overrides if not o.startswith(("algorithm=", "mesh.", "algorithm.every="))]
    return " ".join(["fldp-train -m", f"algorithm={c.algorithm}", *rest, *mesh, *every, "seed=1,2,3"])


def table(fitting: list[Candidate], tokens_per_step: int, capacity):
    from rich import box
    from rich.table import Table

    t = Table(title="Layouts that fit, fastest predicted step first", title_justify="left", box=box.SIMPLE_HEAD)
    for header in (
        "#",
        "algorithm",
        "mesh FxRxS",
        "A",
        "step [s]",
        "step [us/token]",
        "fwd",
        "bwd",
        "opt",
        "agg",
        "comm alone [s]",
        "shard [GB]",
        "replicate [GB]",
        "federation [GB]",
        "memory [GB]",
    ):
        t.add_column(header, justify="left" if header in ("algorithm", "mesh FxRxS") else "right")
    for i, c in enumerate(fitting, 1):
        sent = [f"{c.bytes_per_step[d] / 1e9:.3g}" for d in ("shard", "replicate", "federation")]
        t.add_row(
            str(i),
            c.algorithm,
            c.mesh,
            str(c.every or "-"),
            f"{c.step_s:.4g}",
            f"{c.step_s / tokens_per_step * 1e6:.3g}",
            *(f"{c.phases[p]:.3g}" for p in ("forward", "backward", "optimizer", "aggregation")),
            f"{c.communication_s:.4g}",
            *sent,
            f"{c.memory_gb:.3g}" + ("" if capacity else " (no limit)"),
        )
    return t


def _options(argv: list[str]) -> tuple[list[int], int, bool, list[str]]:
    """--every A,B,... (default 4,8,16), --top K (default 3), --json; the rest are Hydra overrides."""
    everies, top, as_json, rest = [4, 8, 16], 3, False, []
    args = iter(argv)
    for a in args:
        if a in ("--every", "--top"):
            value = next(args, None)
            try:
                parsed = [int(v) for v in (value or "").split(",")]
            except ValueError:
                parsed = []
            if not parsed or min(parsed) < 1:
                raise ConfigError(
                    f"{a} {value}: expects {'integers >= 1, comma separated' if a == '--every' else 'an integer >= 1'}"
                )
            everies, top = (parsed, top) if a == "--every" else (everies, parsed[0])
        elif a == "--json":
            as_json = True
        else:
            rest.append(a)
    return everies, top, as_json, rest


def main(argv: list[str] | None = None) -> None:
    args = tool_arguments(argv, __doc__)
    if args is None:
        return

    def parse():
        everies, top, as_json, overrides = _options(args)
        return everies, top, as_json, overrides, compose(overrides)

    everies, top, as_json, overrides, configs = parsed_or_exit("fldp-plan", parse)
    found = candidates(configs, everies)
    fitting, dropped = ranked(found)
    if as_json:
        print(json.dumps([{**asdict(c), "mesh": c.mesh} for c in fitting + dropped], indent=1))
        return
    _print(configs["fsdp"], fitting, dropped, top, overrides, caveats(configs, fitting))


def caveats(configs: dict, fitting: list[Candidate]) -> list[str]:
    """What makes the ranking on the topology's calibration profile doubtful, one sentence each:
    the compute terms fitted to a bound (fldp.steptime.clamped), and each tier whose fit is so far
    off its own measurements that, were its collectives as far off, a layout's step would move by
    more than steptime.SENSITIVITY (a tier nobody's step leans on may fit poorly)."""
    conf = configs["fsdp"]
    if not conf.topology.profile:
        return []
    import yaml

    from .cost import config_shapes, leads
    from .steptime import (
        SENSITIVITY,
        TIER_TERMS,
        clamped,
        efficiency_for,
        hardware_for,
        phases,
        slower_tier,
        workload_of,
    )

    with open(conf.topology.profile) as f:
        profile = yaml.safe_load(f)
    shapes, _, units = config_shapes(conf)
    work, hw, eff = workload_of(conf, shapes, units), hardware_for(conf.topology), efficiency_for(conf.topology)
    notes, tiers = clamped(profile), profile.get("tiers") or {}
    for name, tier in tiers.items():
        if name not in TIER_TERMS or not fitting:
            continue
        slow = slower_tier(hw, name, 1 + tier["residual"], "inter-node-shared" in tiers)
        moved = [
            (sum(phases(work, c.shape, c.every, slow, eff, leads(configs[c.algorithm])).values()) / c.step_s - 1, c)
            for c in fitting
        ]
        most, worst = max(moved, key=lambda m: m[0])
        if most > SENSITIVITY:
            notes.append(
                f"tier {name}: its fit is {tier['residual']:.0%} (rms) off its own measurements; were its "
                f"collectives as far off, {worst.algorithm} {worst.mesh}'s step would take {most:+.0%}"
            )
    return notes


def _print(conf: Config, fitting, dropped, top: int, overrides: list[str], notes: list[str]) -> None:
    from rich.console import Console

    console = Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 200)
    capacity = conf.topology.memory_gb
    world = conf.topology.nodes * conf.topology.procs_per_node
    tokens = world * conf.trainer.batch_size * conf.dataset.block_size
    console.print(
        f"fldp-plan: model={conf.model.name} ({conf.trainer.precision}), topology={conf.topology.name} "
        f"({world} ranks), memory per rank {'<= ' + format(capacity, 'g') + ' GB' if capacity else 'not limited (topology.memory_gb unset)'}."
    )
    console.print(table(fitting, tokens, capacity))
    if dropped:
        console.print(f"Dropped, not fitting in memory ({len(dropped)}):")
        for c in dropped:
            console.print(f"  {c.algorithm} {c.mesh}" + (f" A={c.every}" if c.every else "") + f": {c.why_not}")
    source = f"the profile {conf.topology.profile}" if conf.topology.profile else "Table 4's fit"
    console.print(
        f"Step: fldp/steptime.py's phases (seconds per step; the aggregation amortised over A) on "
        f"{source}; comm alone: fldp/cost.py's collectives without compute or overlap."
    )
    for note in notes:
        console.print(f"UNRELIABLE profile, the ranking may be off: {note}")
    console.print(f"The top {min(top, len(fitting))}, each as a multirun over 3 seeds:")
    for c in fitting[:top]:
        console.print("  " + command(c, overrides))


if __name__ == "__main__":
    main()
