"""Pre-flight: what a SLURM job would otherwise find out on its nodes, after its wait in the queue,
checked on the submitting host before sbatch (fldp/slurm.py `submit`).

- The data and the tokenizer are local paths that exist: compute nodes have no internet, so a hub
  id or a URL cannot be read there.
- Every path the job reads or writes (run directory, token cache, data, tokenizer, submitit's
  folder) is outside the node-local directories (`cluster.node_local_dirs`): the job's nodes are
  other hosts than this one, so they would not see what is written here, nor each other's.
- (That the run directory is writable fldp.train's check_run_dir has said already, before submit.)
- The token cache of this dataset and tokenizer exists and matches them, so no job tokenises on
  its nodes while the other ranks wait (`python -m fldp.data` makes it).
- For a real submission, also that SLURM is reachable (`no_slurm`); a dry run runs anywhere.

`problems` returns every problem found, each naming its key and what to do."""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

from .data import (
    StaleCache,
    cache_entry,
    env_variable,
    is_glob,
    is_url,
    load_tokenizer,
    local_files,
    looks_local,
    read_cache,
)
from .mesh import ConfigError

NO_INTERNET = "compute nodes have no internet"


def problems(cfg, run_dir: str) -> list[str]:
    """Every reason the job `cfg` submitted with records in `run_dir` would fail on its nodes."""
    data = _data_paths(cfg.dataset)
    # the cache is named by the tokenizer and the source files: checked once they are at hand
    cache = (
        _cache(cfg.dataset)
        if not data
        else [
            f"dataset.cache_dir={cfg.dataset.cache_dir}: not checked until the problems above are fixed; then make "
            f"the token cache with `{prepare_command()}`"
        ]
    )
    return [*data, *_node_local(cfg, run_dir), *cache]


def report(found: list[str]) -> str:
    if not found:
        return "pre-flight: ok"
    return f"pre-flight: {len(found)} problem(s):\n" + "\n".join(f"  - {p}" for p in found)


def prepare_command() -> str:
    """`python -m fldp.data` with this run's overrides, less cluster and hydra ones (no data there)."""
    from hydra.core.hydra_config import HydraConfig

    overrides = ["[the same overrides as this run]"]
    if HydraConfig.initialized():
        overrides = [
            shlex.quote(o)
            for o in HydraConfig.get().overrides.task
            if not o.lstrip("+~").startswith(("cluster", "hydra"))
        ]
    return " ".join(["python -m fldp.data", *overrides])


def _local_dir(d, key: str, what: str) -> list[str]:
    """dataset.<key> must name an existing local directory: not a hub id, nor a missing path."""
    path = str(d[key])
    if not looks_local(path):
        var = env_variable(d, key)
        return [
            f"dataset.{key}={path}: a hub id, but {NO_INTERNET}: set "
            + (f"{var} (or dataset.{key})" if var else f"dataset.{key}")
            + f" to {what}"
        ]
    if not Path(path).expanduser().is_dir():
        return [f"dataset.{key}={path}: no such local directory"]
    return []


def _data_paths(d) -> list[str]:
    # with data_files, dataset.path is a builder name (json, parquet, ...)
    found = [] if d.data_files else _local_dir(d, "path", "a local copy (a directory of its data files)")
    for split, path in (d.data_files or {}).items():
        path = str(path)
        if is_url(path):
            found.append(
                f"dataset.data_files.{split}={path}: a URL, but {NO_INTERNET}: download it and set "
                f"dataset.data_files.{split} to the local file"
            )
        elif not local_files(path):
            found.append(
                f"dataset.data_files.{split}={path}: "
                + ("matches no local file" if is_glob(path) else "no such local file")
            )
    return found + _local_dir(d, "tokenizer", "a local directory holding the tokenizer")


def no_slurm(cfg) -> list[str]:
    """Why nothing can be submitted from here, if so."""
    if shutil.which("sbatch") and shutil.which("srun"):
        return []
    return [
        f"cluster={cfg.cluster.name}: no SLURM reachable from here (sbatch/srun not on PATH); run on the "
        f"cluster's login node, add cluster.dry_run=true to see the job, or use cluster=local"
    ]


def node_local_dirs(cluster) -> list[Path]:
    """cluster.node_local_dirs, a list of directories (fldp.schema has checked it)."""
    return [Path(x).resolve() for x in cluster.get("node_local_dirs") or []]


def _node_local(cfg, run_dir: str) -> list[str]:
    """Paths inside a node-local directory. Even a one-node job runs on another host than this one,
    which writes submitit's pickles and the cache the job reads; so every job is checked."""
    d = cfg.dataset
    paths = {
        "hydra.run.dir": run_dir,
        "dataset.cache_dir": d.cache_dir,
        "dataset.tokenizer": d.tokenizer,
        "cluster.folder": cfg.cluster.folder,
    }
    paths.update({f"dataset.data_files.{split}": path for split, path in (d.data_files or {}).items()})
    if not d.data_files:
        paths["dataset.path"] = d.path
    found = []
    local = node_local_dirs(cfg.cluster)
    for key, path in paths.items():
        if path is None or key.startswith("dataset.") and not looks_local(str(path)):
            continue  # unset, or a hub id or URL (refused above)
        resolved = Path(os.path.expanduser(str(path))).resolve()
        under = next((x for x in local if resolved.is_relative_to(x)), None)
        if under is not None:
            found.append(
                f"{key}={path}: node-local ({under} is not shared with the job's "
                f"{cfg.topology.nodes} node(s)): choose a directory on a shared filesystem "
                f"(or drop {under} from cluster.node_local_dirs if it is shared here)"
            )
    return found


def _cache(d) -> list[str]:
    try:
        path, made_from = cache_entry(d, load_tokenizer(str(d.tokenizer)))
        if read_cache(path, made_from) is not None:
            return []
        return [
            f"dataset.cache_dir={d.cache_dir}: no token cache of dataset {d.name} from this tokenizer and "
            f"these source files, so the job would tokenise on its nodes while the other ranks wait: make "
            f"it here first with `{prepare_command()}` (it writes {path})"
        ]
    except StaleCache as e:
        return [f"{e}: make it again with `{prepare_command()}`"]
    except ConfigError as e:  # a tokenizer directory that does not load
        return [str(e)]
