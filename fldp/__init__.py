"""fldp: reproduction suite for FL+FSDP and FL+HSDP (Mittone & Aldinucci, Euro-Par 2026)."""

from pathlib import Path

from omegaconf import OmegaConf

from . import provenance  # noqa: F401  (reads the commit of the code being imported, now)

ASSETS = Path(__file__).parent / "assets"


def _conf_dir() -> Path:
    """The config groups: `fldp/conf` in an installed wheel (pyproject maps the repository's conf/
    into the package), the repository's own conf/ in a checkout."""
    packaged = Path(__file__).parent / "conf"
    return packaged if (packaged / "config.yaml").is_file() else Path(__file__).resolve().parents[1] / "conf"


# Hydra's config_path (absolute, so it works from a checkout and from site-packages alike)
CONF = _conf_dir()

# ${fldp_asset:diodati_1649/train.jsonl.gz} -> the file shipped inside the package
OmegaConf.register_new_resolver("fldp_asset", lambda rel: str(ASSETS / rel), replace=True)


def _fill(nodes, procs_per_node, *others) -> int:
    """The mesh dimension that fills the world given the other two (at least 1). A sweep over F
    uses it for R; an F that does not divide the world still fails validation, naming F."""
    rest = 1
    for o in others:
        rest *= int(o)
    return max(1, int(nodes) * int(procs_per_node) // max(1, rest))  # a 0 is reported by validation


# ${fldp_fill:${topology.nodes},${topology.procs_per_node},${mesh.federation},${mesh.shard}} -> R
OmegaConf.register_new_resolver("fldp_fill", _fill, replace=True)


def _layout(dim: str, *, _root_) -> int:
    """mesh.<dim> from the topology's layout for the dimensions the algorithm has: algorithm.dims
    [federation, shard] picks topology.layouts.federation_shard."""
    dims = list(_root_.algorithm.get("dims") or [])
    key = "_".join(d for d in ("federation", "replicate", "shard") if d in dims)
    layouts = _root_.topology.layouts
    if key not in layouts:
        raise ValueError(
            f"topology={_root_.topology.name} has no layout for algorithm.dims={dims} "
            f"(topology.layouts.{key}); set mesh.federation/replicate/shard"
        )
    return layouts[key][dim]


# ${fldp_layout:federation} -> F of the layout for this algorithm's dimensions
OmegaConf.register_new_resolver("fldp_layout", _layout, replace=True)


# conf/config.yaml's run-level sections, from the typed configuration (fldp/config.py): `- fldp_run`
from hydra.core.config_store import ConfigStore  # noqa: E402

from .config import run_defaults  # noqa: E402

ConfigStore.instance().store(name="fldp_run", node=run_defaults())

# Sweep points (fldp/sweep.py): hydra.sweep.subdir from the point's overrides, and no .hydra/ written
# over the config of records a run leaves alone
from .sweep import hydra_output_subdir, point_dirname  # noqa: E402

OmegaConf.register_new_resolver("fldp_point_dir", point_dirname, replace=True)
OmegaConf.register_new_resolver("fldp_output_subdir", hydra_output_subdir, replace=True)
