"""What a worker closes before it ends without finishing its run: told to stop (SIGTERM from its
launcher: a Ctrl-C, `kill`), failing (an error), or exiting early (SLURM's requeue).

The Recorder registers its W&B run here (`at_stop`): W&B's offline log holds nothing of a process
that exits without finishing its run, and a forked worker exits through os._exit, which skips
W&B's own atexit teardown. A worker told to stop exits from a Python handler, between the main
thread's bytecodes, so no write of its own is cut short; a signal that arrives inside an
`uninterrupted()` block (a row half sent to W&B) is honoured as the block ends, since finishing W&B
from inside a W&B call would deadlock on W&B's own lock.

Imports nothing of fldp and not torch: records.py uses it, and the launcher installs it."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
from collections.abc import Callable

_hooks: list[Callable[[int], None]] = []
_depth = 0  # open uninterrupted() blocks
_pending: int | None = None  # a signal that arrived inside one
_exit_registered = False


def at_stop(hook: Callable[[int], None]) -> Callable[[], None]:
    """Run hook(exit_code) if this process ends before unregistering it (the function returned).
    Registered after W&B starts, its atexit turn comes before W&B's teardown (atexit runs last
    registered first)."""
    global _exit_registered
    _hooks.append(hook)
    if not _exit_registered:
        atexit.register(run_hooks, 1)  # a plain process (srun's task) ending early; forked workers skip atexit
        _exit_registered = True
    return lambda: _hooks.remove(hook) if hook in _hooks else None


def run_hooks(exit_code: int) -> None:
    """Each hook still registered, once, last registered first; one that fails is reported, and
    never keeps the process alive. A stop signal meanwhile (the launcher stopping the other ranks
    of a failed one) waits for them."""
    with uninterrupted():
        while _hooks:
            hook = _hooks.pop()
            try:
                hook(exit_code)
            except Exception as e:  # noqa: BLE001
                print(f"fldp: while closing (exit code {exit_code}): {e}", file=sys.stderr)


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
    global _pending
    _pending = None
    signal.signal(signum, signal.SIG_IGN)  # a second one while W&B finishes changes nothing
    run_hooks(128 + signum)
    os._exit(128 + signum)
