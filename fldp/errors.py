"""The two errors a run ends with, in one module that imports nothing of fldp: a config that cannot
work (exit 2, before any worker starts) and a worker that failed (exit 1). fldp.mesh and
fldp.launch re-export them under their old names."""


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the key and value."""


class WorkerError(RuntimeError):
    """A worker process failed; the message names its rank and error."""
