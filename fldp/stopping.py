"""How a worker stops when its launcher tells it to (SIGTERM: a Ctrl-C, SLURM, `kill`).

The worker exits from a Python handler, between the main thread's bytecodes, so no write of its
own is cut short. Before it exits it runs what was registered with `at_stop` (the Recorder closes
its W&B run there: W&B's offline log holds nothing of a process that exits without finishing it).
A signal that arrives inside an `uninterrupted()` block (a row half sent to W&B) is honoured as the
block ends: finishing W&B from inside a W&B call would deadlock on W&B's own lock.

Imports nothing of fldp and not torch: records.py uses it, and the launcher installs it."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Callable

_hooks: list[Callable[[int], None]] = []
_depth = 0               # open uninterrupted() blocks
_pending: int | None = None  # a signal that arrived inside one
_stopping = False        # the hooks are running: a second signal changes nothing


def at_stop(hook: Callable[[int], None]) -> Callable[[], None]:
    """Run hook(signum) when this process is told to stop; returns the function that unregisters it."""
    _hooks.append(hook)
    return lambda: _hooks.remove(hook) if hook in _hooks else None


@contextlib.contextmanager
def uninterrupted():
    """A block the stop waits for (it runs as the block ends)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0 and _pending is not None:
            _stop(_pending)


def on_signal(signum, frame) -> None:
    """The handler the launcher installs for SIGTERM in each worker."""
    global _pending
    if _depth:
        _pending = signum
        return
    _stop(signum)


def _stop(signum: int) -> None:
    global _stopping
    if _stopping:
        return
    _stopping = True
    for hook in reversed(list(_hooks)):  # a hook that fails must not keep the worker alive
        try:
            hook(signum)
        except Exception as e:  # noqa: BLE001
            print(f"fldp: while stopping on {signal.Signals(signum).name}: {e}", file=sys.stderr)
    os._exit(128 + signum)
