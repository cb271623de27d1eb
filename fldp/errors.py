"""The errors a run ends with, in one module that imports nothing of fldp: a config that cannot
work (exit 2, before any worker starts), a worker that failed (exit 1), a record or checkpoint that
could not be written (exit 1) and a launcher told to stop (exit 128 + the signal's number).
fldp.mesh and fldp.launch re-export the first two under their old names."""

import signal


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the key and value."""


class WorkerError(RuntimeError):
    """A worker process failed; the message names its rank and error."""


class WriteError(RuntimeError):
    """A record or checkpoint could not be written (disk full, read-only, no permission). The
    message names the path and the system's reason: it is reported alone, since a traceback of
    where the write failed would bury it and says nothing more."""


class Interrupted(KeyboardInterrupt):
    """The launcher got SIGINT or SIGTERM and stopped every worker. A KeyboardInterrupt, so that
    no `except Exception` on the way up swallows it, and a Hydra sweep stops as on Ctrl-C."""

    def __init__(self, signum: int, detail: str = ""):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}: the workers were stopped{detail}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention for a command a signal ended
