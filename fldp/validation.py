"""What a run needs beyond each key's own type and range (fldp.schema): the rules across sections,
checked once, before any worker starts or any job is submitted, each refusal a ConfigError naming
the key (exit 2). The components validate their own invariants on construction (ValueError, as
torchft's do): here they are built from the config up front, and what they refuse is reported as
the config error it is. What needs the data (fldp.data) or a checkpoint (fldp.checkpoint) is
checked where those are read; the command lines' own parsing stays with each command."""

from __future__ import annotations

import logging
import os
import shutil
import socket
from pathlib import Path

from omegaconf import DictConfig

from . import schema, slurm, sweep
from .config import Config, TopologyConfig, load
from .errors import ConfigError
from .mesh import mesh_shape
from .netns import enabled as netns_enabled

log = logging.getLogger("fldp")


def validate(cfg: DictConfig):
    """Fail fast on a config that cannot work; returns the mesh shape. First the schema (every key
    known, typed and in range: fldp.schema) and the mesh, before torch is imported (seconds of a
    refusal's time otherwise); then what needs torch (the model's parameters, the devices)."""
    schema.check(cfg)
    shape = mesh_shape(cfg)  # composed: its errors name where the mesh came from
    check_with_torch(load(cfg))
    return shape


def check_with_torch(conf: Config) -> None:
    """What ties the groups together and needs torch: the algorithm's patterns and fragments against
    the model's parameters, elastic federation, the devices, the emulated network."""
    import torch

    from . import launch

    federation = federation_of(conf)
    if federation is not None and federation.streaming.overlap and conf.comm.emulate:
        raise ConfigError(
            f"algorithm.streaming.overlap={federation.streaming.overlap} with comm.emulate=true: the "
            "emulation sleeps as each collective is called, so it cannot show an all-reduce in "
            "flight behind training; emulate the network with a netns topology (e.g. topology=netns_4x2)"
        )
    check_elastic(conf)
    if slurm.submits(conf.cluster):
        check_slurm(conf)
    if conf.cluster.name == "simulate":  # no ranks, no network: the topology gives only the mesh
        check_simulation(conf)
        return
    if conf.topology.device == "cuda" and not slurm.submits(conf.cluster) and not torch.cuda.is_available():
        raise ConfigError(
            f"topology.device=cuda (topology={conf.topology.name}): no CUDA device here, where "
            f"cluster={conf.cluster.name}, cluster.launcher={conf.cluster.launcher} runs the workers"
        )
    forks_locally = launch.from_environment() is None and not slurm.submits(conf.cluster)
    # emulated nodes: the link's keys, root, `ip` and `tc`
    check_launch(conf, forks_locally)


def checked(cfg: DictConfig) -> Config:
    """The composed config checked as far as a calculation needs (fldp-cost, fldp-plan,
    fldp-calibrate): every key (fldp.schema), then the algorithm's components built; typed."""
    schema.check(cfg)
    conf = load(cfg)
    federation_of(conf)
    return conf


def federation_of(conf: Config):
    """FedAvg's config as the workers will build it (fldp.aggregation: its schedule, streaming and
    codec), checked against the model's parameter names: every algorithm.federate pattern must name
    one, and the federated ones must have an FSDP unit for every streaming fragment. None: the
    algorithm does not federate."""
    from .aggregation import FedAvgConfig
    from .quantize import codec_of

    try:
        codec_of(conf.algorithm.outer)
        federation = FedAvgConfig.from_algorithm(conf.algorithm)
        if federation is not None and (federation.federate != (".*",) or federation.streaming.fragments > 1):
            from .model import build_model, llama_config

            model = build_model(llama_config(conf.model, conf.model.vocab_size or 8), "meta")
            names = [name for name, _ in model.named_parameters()]
            federation.streaming.fragment_of([n for n, keep in zip(names, federation.federated(names)) if keep])
    except ValueError as e:  # a component's invariant (or a ConfigError of its keys): the message names the key
        raise ConfigError(str(e)) from None
    return federation


def check_simulation(conf: Config) -> None:
    """What cluster=simulate (fldp/simulate.py) cannot do."""
    import torch

    trainer = conf.trainer
    if trainer.checkpoint_every or trainer.resume:
        raise ConfigError(
            f"trainer.checkpoint_every={trainer.checkpoint_every}, trainer.resume="
            f"{trainer.resume}: cluster=simulate keeps no checkpoints (a simulated run is "
            "short enough to run again)"
        )
    if conf.comm.emulate:
        raise ConfigError("comm.emulate=true: cluster=simulate sends nothing to emulate")
    reduce_dtype = conf.fsdp.reduce_dtype
    if reduce_dtype not in (None, trainer.precision) and conf.cluster.reductions != "ring":
        raise ConfigError(
            f"fsdp.reduce_dtype={reduce_dtype}: cluster.reductions=once computes each group's gradient "
            "from its whole batch, with no reduction to cast; use cluster.reductions=ring"
        )
    if conf.cluster.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("cluster.device=cuda: no CUDA device here")


def check_elastic(conf: Config) -> None:
    """Elastic federation's preconditions, before any worker starts."""
    algorithm = conf.algorithm
    if not algorithm.elastic:
        return
    if algorithm.aggregation != "fedavg":
        raise ConfigError(
            f"algorithm.elastic=true: algorithm={algorithm.name} has no federation "
            "dimension to be elastic in (fl_fsdp, fl_hsdp, diloco_hsdp have)"
        )
    if conf.cluster.name == "simulate":
        raise ConfigError(
            "algorithm.elastic=true on cluster=simulate: the simulator runs every group in one "
            "process, with nothing to fail apart"
        )
    if conf.topology.device != "cpu":
        raise ConfigError(
            f"algorithm.elastic=true on topology.device={conf.topology.device}: only gloo (cpu) is supported so far"
        )
    federate = list(algorithm.federate or [".*"])
    if federate != [".*"]:
        raise ConfigError(
            f"algorithm.elastic=true with algorithm.federate={federate}: a healed group's "
            "parameters kept local would be copied from several peers, rank by rank; partial "
            "federation is not elastic yet"
        )
    from .streaming import StreamingConfig

    streaming = StreamingConfig.from_algorithm(algorithm)
    if streaming.fragments != 1 or streaming.exchanges:
        raise ConfigError(
            f"algorithm.elastic=true with algorithm.streaming.fragments={streaming.fragments}, "
            f"overlap={streaming.overlap}, alpha={streaming.alpha}: a restarted group heals at a "
            "whole-model aggregation taken as it is; streaming is not elastic yet"
        )
    quantize = algorithm.outer.quantize
    if quantize:
        raise ConfigError(
            f"algorithm.elastic=true with algorithm.outer.quantize={quantize}: the elastic "
            "aggregation is torchft's all-reduce over the groups alive; a quantised one is not built yet"
        )
    if conf.trainer.checkpoint_every or conf.trainer.resume:
        raise ConfigError(
            f"algorithm.elastic=true with trainer.checkpoint_every={conf.trainer.checkpoint_every}, "
            f"trainer.resume={conf.trainer.resume}: a failed group heals from a live peer; "
            "checkpoints of elastic runs are not built yet"
        )
    if conf.comm.emulate:
        raise ConfigError(
            "algorithm.elastic=true with comm.emulate=true: the sleeps stand for the static "
            "collectives only; emulate the network with a netns topology (e.g. topology=netns_4x2)"
        )


def check_slurm(conf: Config) -> None:
    """A SLURM job's own keys: one rank per GPU, and a submitit folder sbatch can write its logs in."""
    c, t = conf.cluster, conf.topology
    if t.device == "cuda":
        if c.gpus_per_node is None:
            raise ConfigError(
                f"cluster.gpus_per_node=null but topology={t.name} runs on cuda: set it to "
                f"topology.procs_per_node={t.procs_per_node} (one rank per GPU)"
            )
        if c.gpus_per_node != t.procs_per_node:
            raise ConfigError(
                f"cluster.gpus_per_node={c.gpus_per_node} but topology.procs_per_node="
                f"{t.procs_per_node}: fldp runs one rank per GPU"
            )
    if c.folder and "%" in str(c.folder):
        raise ConfigError(
            f"cluster.folder={c.folder}: sbatch reads '%' in a log path as a "
            "file-name pattern; choose a folder without one"
        )


def check_submission(cfg: DictConfig, run_dir: str) -> None:
    """Only where sbatch is, and only a job its nodes can run (fldp.preflight: what the job would
    find out after its wait in the queue): every problem named, nothing submitted."""
    from . import preflight

    if found := [*preflight.no_slurm(cfg), *preflight.problems(cfg, run_dir)]:
        raise ConfigError(f"nothing submitted; {preflight.report(found)}")


def check_launch(conf: Config, forks_locally: bool) -> None:
    """Where the workers meet: emulated nodes (a network of the run's own), or cluster.master_addr,
    which this machine must be able to listen at when it forks them (fldp.launch.run_local,
    fldp.elastic.run_local). An elastic run's supervisor under cluster.launcher=slurm forks nothing:
    it starts each group as a job step, which meets at the allocation's first node."""
    check_netns(conf, forks_locally)
    job_steps = conf.algorithm.elastic and conf.cluster.launcher == "slurm"
    if forks_locally and not job_steps and not netns_enabled(conf.topology):
        check_listenable(conf.cluster.master_addr)


def check_netns(conf: Config, forks_locally: bool) -> None:
    """Emulated nodes (fldp.netns): the topology's link, and whether this machine can build it
    (root, iproute2). Nothing to check for topologies without them."""
    topology = conf.topology
    if not netns_enabled(topology):
        return
    check_link(topology)
    name = f"topology={topology.name} (emulation=netns)"
    if not forks_locally:
        raise ConfigError(
            f"{name}: the emulated nodes exist only for workers this launcher forks "
            "(cluster=local, not under torchrun or srun)"
        )
    if topology.device != "cpu":
        raise ConfigError(f"topology.device={topology.device!r}: {name} runs gloo on cpu")
    if conf.comm.emulate:
        raise ConfigError(f"comm.emulate=true: {name} already has a real capped link; the sleeps would count it twice")
    if topology.nodes < 2 or topology.nodes > 250:
        raise ConfigError(f"topology.nodes={topology.nodes}: {name} needs 2 to 250 nodes")
    missing_tools(name)


def check_link(topology: TopologyConfig) -> None:
    """The inter-node tier of a netns topology (the outermost tier of `topology.network`): every
    error names its key."""
    network = topology.network or []
    if len(network) < 2:
        raise ConfigError(
            f"topology.network (topology={topology.name}): emulation=netns needs two tiers, "
            "the node (namespace loopback) and the inter-node link"
        )
    i = len(network) - 1
    tier = network[i]
    key = f"topology.network[{i}]"
    for field, value, ok in (
        ("gbit_s", tier.get("gbit_s"), lambda v: v > 0),
        ("delay_ms", tier.get("delay_ms", 0), lambda v: v >= 0),
    ):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            raise ConfigError(f"{key}.{field}={value!r}: must be a number {'> 0' if field == 'gbit_s' else '>= 0'}")
    if tier.get("link") != "node":
        raise ConfigError(
            f"{key}.link={tier.get('link')!r}: must be 'node' with topology.emulation=netns "
            "(the rate is each node's link, shared by its ranks)"
        )


def missing_tools(name: str) -> None:
    """Root and iproute2's `ip` and `tc`, or a ConfigError saying which is missing."""
    if os.geteuid() != 0:
        raise ConfigError(
            f"{name} needs root to create network namespaces (running as uid {os.geteuid()}); "
            "use a topology without emulation (e.g. topology=local_8)"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ConfigError(
                f"{name} needs the `{tool}` command (Debian: apt-get install iproute2), not found on PATH"
            )


def check_wandb_login(cfg) -> None:
    """wandb.mode=online needs a key before any worker starts: W&B would otherwise ask for one on
    standard input, which neither CI nor a compute node has."""
    if cfg.wandb.mode != "online" or os.environ.get("WANDB_API_KEY"):
        return
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    try:
        known = netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        known = False
    if not known:
        raise ConfigError(
            f"wandb.mode=online: no W&B API key for {host} (set WANDB_API_KEY, or run `wandb login` "
            f"once); or use wandb.mode=offline and `wandb sync` later"
        )


def check_listenable(addr: str | None) -> None:
    """ConfigError, before any worker starts, when this machine cannot listen at `addr`."""
    with socket.socket() as s:
        try:
            s.bind((addr, 0))
        except (OSError, TypeError, OverflowError) as e:  # a name that does not resolve, an address not here
            raise ConfigError(f"cluster.master_addr={addr!r}: cannot listen there ({e})") from None


def check_run_dir(conf: Config, shape, run_dir: str) -> None:
    """Writable, and not holding another run's records unless this run resumes it."""
    from .aggregation import FedAvgConfig
    from .checkpoint import check_mesh, check_schedule, latest

    path = Path(run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".fldp-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"hydra.run.dir={run_dir}: not writable ({e.strerror})") from e
    check_not_another_run(conf.trainer.resume, run_dir)
    saved = latest(path) if conf.trainer.resume == "auto" else None
    if saved is not None:
        check_mesh(saved, shape)
        federation = FedAvgConfig.from_algorithm(conf.algorithm)
        check_schedule(
            saved,
            federation.schedule if federation else None,
            federation.streaming.fragments if federation else 1,
            federation,
        )


def check_not_another_run(resume: str | None, run_dir: str) -> None:
    """trainer.resume: a directory holding a run is refused unless the run resumes it."""
    if sweep.refused(run_dir, resume):
        raise ConfigError(
            f"hydra.run.dir={run_dir} already holds a run's metrics.jsonl or checkpoints/: "
            f"continue it with trainer.resume=auto, or choose another hydra.run.dir"
        )


def check_vocab(conf: Config, blocks) -> None:
    vocab = conf.model.vocab_size
    if vocab is not None and blocks.vocab_size > vocab:
        raise ConfigError(
            f"dataset.tokenizer={conf.dataset.tokenizer} has {blocks.vocab_size} tokens but "
            f"model.vocab_size={vocab}: token ids would overflow the embedding"
        )


def check_passes(conf: Config, blocks, world: int) -> None:
    """A run never cycles its data unless dataset.max_passes allows it; where it does, it says so."""
    d, steps, batch = conf.dataset, conf.trainer.steps, conf.trainer.batch_size
    if not steps:  # null: one pass
        return
    asked, have = steps * world * batch, len(blocks.train)
    passes = asked / have
    tokens = f"{asked:,} blocks of {d.block_size} tokens ({asked * d.block_size / 1e6:.2f} M tokens)"
    if d.max_passes is not None and passes > d.max_passes:
        raise ConfigError(
            f"dataset.max_passes={d.max_passes}: trainer.steps={steps} x {world * batch} sequences "
            f"a step ask for {tokens}, {passes:.2f} passes over {d.name}'s {have:,} training blocks; "
            f"lower trainer.steps to at most {int(d.max_passes * have) // (world * batch)} "
            "or raise dataset.max_passes"
        )
    if passes > 1:
        log.warning("the run makes %.2f passes over %s's training blocks: %s", passes, d.name, tokens)


def check_blocks(conf: Config, blocks, world: int) -> None:
    """One batch per rank in each split, or the workers would fail on it (trainer.total_steps, evaluate)."""
    check_passes(conf, blocks, world)
    d, batch = conf.dataset, conf.trainer.batch_size
    for split, n, key in (
        ("training", len(blocks.train), "train_blocks"),
        ("held-out", len(blocks.eval), "eval_blocks"),
    ):
        if n // world < batch:
            raise ConfigError(
                f"dataset.{key}={getattr(d, key)}: {n} {split} blocks of dataset.block_size={d.block_size} "
                f"tokens are too few for trainer.batch_size={batch} on each of {world} ranks "
                f"(need {batch * world})"
            )
