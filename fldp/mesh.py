"""The 3-D process mesh: federation x replicate x shard, outermost first.

world = F * R * S. Rank r sits at (r // (R*S), (r // S) % R, r % S): consecutive ranks share a
sharding group, so with node-major ranks a sharding group of procs_per_node is one node.
The four algorithms are four shapes of this mesh: each declares the dimensions it has
(conf/algorithm/*.yaml `dims`); the others are pinned to 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError  # noqa: F401  (also fldp.mesh.ConfigError, as before)

DIMS = ("federation", "replicate", "shard")


@dataclass(frozen=True)
class MeshShape:
    federation: int
    replicate: int
    shard: int

    @property
    def world(self) -> int:
        return self.federation * self.replicate * self.shard

    @property
    def group_size(self) -> int:
        """Ranks in one federation group (the pool that trains one model replica set)."""
        return self.replicate * self.shard

    def coords(self, rank: int) -> tuple[int, int, int]:
        return (rank // self.group_size, (rank // self.shard) % self.replicate, rank % self.shard)

    def __str__(self) -> str:
        return f"{self.federation}x{self.replicate}x{self.shard}"


def shard_piece(rows: int, shards: int) -> int:
    """The rows of dim 0 FSDP2's Shard(0) gives each of `shards` ranks, and pads each shard to in its
    all-gather and reduce-scatter buffers (the last shards short or empty)."""
    return -(-rows // shards)


def _positive_int(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}={value!r}: must be an integer >= 1")
    return value


def mesh_shape(cfg) -> MeshShape:
    """Validate the mesh of a composed config against its algorithm and topology."""
    algorithm = cfg.algorithm.name
    dims = algorithm_dims(cfg.algorithm)
    try:
        shape = MeshShape(*(_positive_int(f"mesh.{d}", getattr(cfg.mesh, d)) for d in DIMS))
    except ValueError as e:  # the layout resolver: no layout for these dimensions
        raise ConfigError(str(e)) from None
    for dim in DIMS:
        if dim not in dims and getattr(shape, dim) != 1:
            raise ConfigError(
                f"mesh.{dim}={getattr(shape, dim)}: algorithm={algorithm} needs mesh.{dim}=1 "
                f"(its dimensions are algorithm.dims={dims}; choose an algorithm with a {dim} dimension)"
            )
    world = world_size(cfg)
    if shape.world != world:
        raise ConfigError(
            f"mesh.federation x mesh.replicate x mesh.shard = {shape} = {shape.world} ranks, but "
            f"topology={cfg.topology.name} has {world} (topology.nodes={cfg.topology.nodes} x "
            f"topology.procs_per_node={cfg.topology.procs_per_node}){_layout_source(cfg, dims)}"
        )
    return shape


def _layout_source(cfg, dims: list[str]) -> str:
    """Where a mesh taken from the topology's layouts came from, for an error about it."""
    from typing import cast

    from omegaconf import OmegaConf

    raw = cast(dict, OmegaConf.to_container(cfg.mesh, resolve=False)) if OmegaConf.is_config(cfg.mesh) else {}
    if not any("fldp_layout" in str(raw.get(d)) for d in DIMS):  # set by hand: the message names mesh.*
        return ""
    key = "_".join(d for d in DIMS if d in dims)
    return f"; the mesh is topology.layouts.{key}, the layout for algorithm.dims={dims}"


def algorithm_dims(algorithm_cfg) -> list[str]:
    """The mesh dimensions an algorithm declares (conf/algorithm/*.yaml `dims`); the shard dim always."""
    dims = list(getattr(algorithm_cfg, "dims", None) or [])  # typed, or composed
    if not dims or "shard" not in dims or any(d not in DIMS for d in dims):
        raise ConfigError(f"algorithm.dims={dims}: must list mesh dimensions among {list(DIMS)}, shard included")
    return dims


def world_size(cfg) -> int:
    nodes = _positive_int("topology.nodes", cfg.topology.nodes)
    return nodes * _positive_int("topology.procs_per_node", cfg.topology.procs_per_node)


def build_mesh(shape: MeshShape, device_type: str):
    """The full 3-D DeviceMesh; needs an initialised default process group of shape.world ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (shape.federation, shape.replicate, shape.shard), mesh_dim_names=DIMS)


def group_mesh(mesh, shape: MeshShape):
    """The mesh FSDP2 shards over inside one federation group: 1-D (shard) for FSDP, 2-D
    (replicate, shard) for HSDP. Slicing the 3-D mesh yields this rank's own group."""
    return mesh["shard"] if shape.replicate == 1 else mesh["replicate", "shard"]
