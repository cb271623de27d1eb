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


class NoPeerToHealFrom(RuntimeError):
    """A restarted federation group found no live group to heal from: every other one had ended.
    Not a failure of its own: its ranks exit with EXIT_CODE, and the supervisor (fldp.elastic) ends
    the run with the groups that finished, or fails it if none did."""

    EXIT_CODE = 3


class Interrupted(KeyboardInterrupt):
    """The launcher got SIGINT or SIGTERM and stopped every worker. A KeyboardInterrupt, so that
    no `except Exception` on the way up swallows it, and a Hydra sweep stops as on Ctrl-C."""

    def __init__(self, signum: int, detail: str = ""):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}: the workers were stopped{detail}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention for a command a signal ended


def tool_arguments(argv: list[str] | None, doc: str | None) -> list[str] | None:
    """A tool's command line (sys.argv's by default); None, with `doc` printed, for -h / --help."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(doc)
        return None
    return args


def parsed_or_exit(tool: str, parse):
    """parse(): a tool's reading of its command line; bad input (a ConfigError, or Hydra's own)
    ends the tool with its message and exit 2, before any worker starts."""
    import sys

    from hydra.errors import HydraException

    try:
        return parse()
    except (ConfigError, HydraException) as e:
        print(f"{tool}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
