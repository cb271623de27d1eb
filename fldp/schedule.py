"""When FL aggregates: algorithm.every as a schedule, and the steps it makes aggregate. One
definition for the trainer, the simulator, the cost model and the analysis; it imports nothing of
fldp but its errors, so the config schema can check a schedule with it."""

from __future__ import annotations

import functools


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def schedule_of(every) -> tuple[tuple[int, int], ...]:
    """algorithm.every as ((first step after which it holds, A), ...): an integer A is ((0, A),);
    a schedule [[0, 1], [16, 8]] is A = 1 for steps 1..16, then A = 8 (when, see aggregation_steps)."""
    pairs = [[0, every]] if _number(every) and not isinstance(every, float) else every
    try:
        phases = tuple((int(start), int(period)) for start, period in pairs)
        valid = (
            all(isinstance(x, int) and not isinstance(x, bool) for pair in pairs for x in pair)
            and phases[0][0] == 0
            and all(a >= 1 for _, a in phases)
            and all(s1 < s2 for (s1, _), (s2, _) in zip(phases, phases[1:]))
        )
    except (TypeError, ValueError, IndexError):
        valid = False
    if not valid:
        raise ValueError(
            f"algorithm.every={every!r}: must be an integer A >= 1, or a schedule "
            f"[[0, A0], [step1, A1], ...] of increasing steps from 0 and periods >= 1"
        )
    return phases


@functools.lru_cache(maxsize=64)
def aggregation_steps(schedule: tuple[tuple[int, int], ...], last_step: int) -> tuple[int, ...]:
    """The steps that aggregate, the one definition (trainer, cost model, analysis): step s does when
    at least A steps have passed since the previous aggregation (0 at the start), A being the period
    of the phase holding s (phase p holds the steps > start_p, up to the next phase's start), and
    the last step always does. So [[0, 8], [12, 8]] is every 8 steps and [[0, 8], [12, 16]] is 8,
    24, 40, ... A function of the schedule and the step numbers alone: a resumed run agrees."""
    steps: list[int] = []
    previous = 0
    ends = [start for start, _ in schedule[1:]] + [last_step]
    for (start, period), end in zip(schedule, ends):
        # the phase's steps start+1..end: the first at least `period` after the previous one
        steps += range(max(previous + period, start + 1), min(end, last_step) + 1, period)
        previous = steps[-1] if steps else previous
    if last_step >= 1 and (not steps or steps[-1] != last_step):
        steps.append(last_step)
    return tuple(steps)


def schedule_text(every) -> str:
    """algorithm.every in words: 'every 8 steps', 'every 1 steps, then every 8 after step 16'."""
    every = every if isinstance(every, (int, float, str)) else [list(pair) for pair in every]
    phases = schedule_of(every)
    return f"every {phases[0][1]} steps" + "".join(f", then every {a} after step {start}" for start, a in phases[1:])
