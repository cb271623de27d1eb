"""The 3-D process mesh: federation x replicate x shard, outermost first.

world = F * R * S. Rank r sits at (r // (R*S), (r // S) % R, r % S): consecutive ranks share a
sharding group, so with node-major ranks a sharding group of procs_per_node is one node.
The four algorithms are four shapes of this mesh; the rules below are all that tells them apart here.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError  # noqa: F401  (also fldp.mesh.ConfigError, as before)

DIMS = ("federation", "replicate", "shard")

# Dimensions each algorithm pins to 1.
PINNED = {
    "fsdp": ("federation", "replicate"),
    "hsdp": ("federation",),
    "fl_fsdp": ("replicate",),
    "fl_hsdp": (),
}


_NEEDS = {"federation": "algorithm=fl_fsdp or fl_hsdp", "replicate": "algorithm=hsdp or fl_hsdp"}


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


def _positive_int(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}={value!r}: must be an integer >= 1")
    return value


def mesh_shape(cfg) -> MeshShape:
    """Validate the mesh of a composed config against its algorithm and topology."""
    algorithm = cfg.algorithm.name
    if algorithm not in PINNED:
        raise ConfigError(f"algorithm.name={algorithm!r}: must be one of {sorted(PINNED)}")
    shape = MeshShape(*(_positive_int(f"mesh.{d}", cfg.mesh[d]) for d in DIMS))
    for dim in PINNED[algorithm]:
        if getattr(shape, dim) != 1:
            raise ConfigError(
                f"mesh.{dim}={getattr(shape, dim)}: algorithm={algorithm} needs mesh.{dim}=1 "
                f"(a {dim} dimension needs {_NEEDS[dim]})"
            )
    world = world_size(cfg)
    if shape.world != world:
        raise ConfigError(
            f"mesh.federation x mesh.replicate x mesh.shard = {shape} = {shape.world} ranks, but "
            f"topology={cfg.topology.name} has {world} (topology.nodes={cfg.topology.nodes} x "
            f"topology.procs_per_node={cfg.topology.procs_per_node})"
        )
    return shape


def world_size(cfg) -> int:
    nodes = _positive_int("topology.nodes", cfg.topology.nodes)
    return nodes * _positive_int("topology.procs_per_node", cfg.topology.procs_per_node)


def build_mesh(shape: MeshShape, device_type: str):
    """The full 3-D DeviceMesh; needs an initialised default process group of shape.world ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        device_type, (shape.federation, shape.replicate, shape.shard), mesh_dim_names=DIMS
    )


def group_mesh(mesh, shape: MeshShape):
    """The mesh FSDP2 shards over inside one federation group: 1-D (shard) for FSDP, 2-D
    (replicate, shard) for HSDP. Slicing the 3-D mesh yields this rank's own group."""
    return mesh["shard"] if shape.replicate == 1 else mesh["replicate", "shard"]
