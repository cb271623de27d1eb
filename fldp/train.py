"""`python -m fldp.train [overrides]`: one experiment.

Everything that can be checked is checked before any worker starts (fldp.validation, called
here): the mesh against the algorithm and topology, the trainer and optimiser settings, the data
and tokenizer paths.

torch and what imports it (launch, aggregation, checkpoint, data) are imported by the
functions that need them, not at the top: `--help`, `--cfg job` and shell completion need none of
it, and importing torch takes seconds."""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import logging
import os
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import cast

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from . import CONF, netns, schema, slurm, sweep
from .config import Config, load
from .errors import ConfigError, Interrupted, WorkerError, WriteError
from .provenance import record_command, version_line
from .validation import (
    check_blocks,
    check_not_another_run,
    check_run_dir,
    check_submission,
    check_vocab,
    check_wandb_login,
    validate,
)

log = logging.getLogger("fldp")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are forked after tokenising


def _rank(cfg, run_dir, blocks, device):
    from .trainer import train  # transformers: imported after validation, so bad configs fail fast

    train(cfg, run_dir, blocks, device)


def _group_rank(cfg, run_dir, blocks, member, device):
    """A rank of an elastic run: its process group is its federation group's."""
    from .trainer import train

    train(cfg, run_dir, blocks, device, member=member)


def run(cfg: DictConfig, run_dir: str, sweep_point: bool = False) -> dict | None:
    """Validate the config, then run it where cluster and launcher say: simulated in this process,
    submitted to SLURM, on workers forked here, or as one rank of a world torchrun or srun started."""
    from . import launch

    shape = validate(cfg)
    conf = load(cfg)  # what the checks below read; cfg as composed travels to the records
    check_wandb_login(cfg)
    env = launch.from_environment()
    if conf.cluster.name == "simulate":  # every federation group in this process
        return run_simulated(cfg, conf, run_dir, shape)
    if env is None and slurm.submits(conf.cluster):  # one SLURM job; the ranks run this function again inside it
        check_run_dir(conf, shape, run_dir)
        if not conf.cluster.dry_run:  # a dry run lists what the preflight finds
            check_submission(cfg, run_dir)
        # fldp.train.run by reference: under `python -m fldp.train` this module is __main__, whose
        # functions cloudpickle would copy by value into the job
        return slurm.submit(cfg, run_dir, shape, importlib.import_module("fldp.train").run, sweep_point)
    if env is None:
        return run_forked(cfg, conf, run_dir, shape)
    run_rank(cfg, conf, run_dir, shape, env)
    return None


def checked_blocks(cfg: DictConfig, conf: Config, world: int):
    """The run's token blocks (tokenised once, then cached: the cache's key hashes the composed
    dataset section), checked against the model and the world."""
    from .data import prepare

    blocks = prepare(cfg.dataset)
    check_vocab(conf, blocks)
    check_blocks(conf, blocks, world)
    announce_model(conf, blocks.vocab_size)
    return blocks


def announce_model(conf: Config, vocab_size: int) -> None:
    """The model's size, counted on the meta device (nothing allocated); summary.json records it too."""
    from .model import build_model, llama_config, parameter_counts

    n = parameter_counts(build_model(llama_config(conf.model, vocab_size), "meta"))
    log.info(
        "model %s: %.2f M parameters, N = %.2f M without the embedding and lm_head",
        conf.model.name, n["params"] / 1e6, n["params_non_embedding"] / 1e6,
    )  # fmt: skip


def run_simulated(cfg: DictConfig, conf: Config, run_dir: str, shape) -> dict:
    """cluster=simulate: every federation group in this process (fldp/simulate.py)."""
    check_run_dir(conf, shape, run_dir)
    blocks = checked_blocks(cfg, conf, shape.world)
    from . import simulate

    log.info(
        "%s simulated in one process: mesh %s (federation x replicate x shard), records in %s",
        conf.algorithm.name,
        shape,
        run_dir,
    )
    return simulate.run(cfg, run_dir, blocks)


def run_forked(cfg: DictConfig, conf: Config, run_dir: str, shape) -> dict:
    """The world's workers forked on this machine; the summary. A stopped or failed run names
    where it can resume from."""
    from .checkpoint import discard_incomplete

    check_run_dir(conf, shape, run_dir)
    blocks = checked_blocks(cfg, conf, shape.world)
    from . import trainer  # noqa: F401  (import once here, not in each of the forked workers)
    from .model import import_forward

    import_forward()

    log.info(
        "%s on %s: mesh %s (federation x replicate x shard), %d local workers, records in %s",
        conf.algorithm.name,
        conf.topology.name,
        shape,
        shape.world,
        run_dir,
    )
    try:
        launch_workers(cfg, conf, run_dir, shape, blocks)
    except Interrupted as e:
        discard_incomplete(run_dir)  # every worker has exited: a checkpoint without COMPLETE is a cut save
        raise Interrupted(e.signum, f"; {resume_hint(run_dir)}") from None
    except WorkerError as e:
        discard_incomplete(run_dir)
        raise WorkerError(f"{e}\n{resume_hint(run_dir)}") from None
    return json.loads((Path(run_dir) / "summary.json").read_text())


def launch_workers(cfg: DictConfig, conf: Config, run_dir: str, shape, blocks) -> None:
    """The workers (each given the composed cfg), on emulated nodes if the topology has them;
    elastic: each federation group its own world, restarted when it fails."""
    from . import launch

    if conf.algorithm.elastic:
        from . import elastic

        if conf.cluster.launcher == "slurm":  # the supervisor, inside the run's one job
            elastic.run_slurm(cfg, run_dir, shape)
        else:
            elastic.run_local(
                _group_rank, (cfg, run_dir, blocks), shape, cfg.cluster, run_dir, network=netns.from_config(conf)
            )
    else:
        launch.run_local(
            _rank,
            (cfg, run_dir, blocks),
            shape.world,
            conf.topology.device,
            cfg.cluster,
            network=netns.from_config(conf),
        )


def run_rank(cfg: DictConfig, conf: Config, run_dir: str, shape, env) -> None:
    """One rank of a world started by torchrun or srun."""
    import torch.distributed as dist

    from . import launch
    from .data import prepare

    if env.world != shape.world:
        raise ConfigError(f"WORLD_SIZE={env.world} from the launcher, but mesh {shape} needs {shape.world} ranks")
    device = launch.init_process_group(env, conf.topology.device, conf.cluster.timeout_s)
    if env.rank == 0:  # tokenise once; the others read the cache
        blocks = prepare(cfg.dataset)
    dist.barrier()
    if env.rank != 0:
        blocks = prepare(cfg.dataset)
    check_vocab(conf, blocks)
    check_blocks(conf, blocks, shape.world)
    shared = [run_dir]
    dist.broadcast_object_list(shared, src=0)  # ranks may disagree on Hydra's timestamped dir
    _rank(cfg, shared[0], blocks, device)
    # Torn down on success only: a failing rank leaves with its connections open, so it reports its
    # error before its peers fail of the lost connection (the launcher reports the earliest error).
    dist.destroy_process_group()


def resume_hint(run_dir: str) -> str:
    """Where a stopped local run can continue from."""
    from .checkpoint import latest

    saved = latest(run_dir)
    where = (
        f"from {saved} (step {int(saved.name.split('_')[1])})" if saved else "from the start (no complete checkpoint)"
    )
    return f"continue {where} with trainer.resume=auto hydra.run.dir={run_dir}"


def name_the_sweep(cfg: DictConfig) -> None:
    """A multirun point's W&B group is its sweep, unless wandb.group is set: the sweep directory's
    last two parts (multirun/DATE/TIME -> DATE_TIME), the same for every point of one sweep."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN and cfg.wandb.group is None:
        cfg.wandb.group = "_".join(Path(hydra_cfg.sweep.dir).parts[-2:])


# What Hydra writes into a run directory before the run starts (hydra.job.name is "train")
HYDRA_FILES = {".hydra", "train.log"}
# whether the single run's directory is new (Hydra creates it): set by precheck, read by main
_new_run_dir: bool | None = None


@hydra.main(config_path=str(CONF), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict | None:
    run_dir = HydraConfig.get().runtime.output_dir
    multirun = HydraConfig.get().mode == RunMode.MULTIRUN
    if sweep.skips(run_dir, multirun, cfg.trainer.get("skip_finished")):
        # before validation: a finished point stands on its records, whatever this config now says
        log.info(
            "skipped: %s already finished (summary.json); trainer.skip_finished=false trainer.resume=auto "
            "runs it again",
            run_dir,
        )
        return None
    name_the_sweep(cfg)
    try:
        summary = run(cfg, run_dir, sweep_point=multirun)
    except Interrupted as e:  # also in a sweep: Ctrl-C stops the sweep, not only this point
        print(f"fldp: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:  # Ctrl-C before any worker started (say, while tokenising)
        print("fldp: interrupted by SIGINT before any worker started", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except (ConfigError, WorkerError, WriteError) as e:
        if multirun:
            # Hydra records this point as failed and runs the others; only at the end does it raise
            # the first failure, so say now which point failed and why.
            log.error(
                "sweep point #%s (%s) failed: %s",
                HydraConfig.get().job.num,
                " ".join(HydraConfig.get().overrides.task),
                e,
            )
            raise
        if isinstance(e, ConfigError) and _new_run_dir:
            remove_hydra_files(run_dir)
        print(f"fldp: {'config error' if isinstance(e, ConfigError) else 'run failed'}: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, ConfigError) else 1)
    if summary:
        log.info(
            "train perplexity %.2f in %.2f s, eval perplexity %.2f in %.2f s",
            summary["train_perplexity"],
            summary["train_time_s"],
            summary["eval_perplexity"],
            summary["eval_time_s"],
        )
        for offline in sorted(Path(run_dir).glob("wandb/offline-run-*")):
            log.info("W&B offline run in %s; upload it with: wandb sync %s", offline, offline)
    return summary


def remove_hydra_files(run_dir: str) -> None:
    """A refused run leaves nothing: the new directory Hydra made for it (its .hydra/ and train.log,
    nothing else), and the parents it made that are left empty, up to the working directory."""
    path = Path(run_dir).absolute()
    if not path.is_dir() or not {p.name for p in path.iterdir()} <= HYDRA_FILES:
        return
    logging.shutdown()  # train.log's handler
    shutil.rmtree(path, ignore_errors=True)
    for parent in path.parents:
        if parent == Path.cwd() or not parent.is_relative_to(Path.cwd()) or any(parent.iterdir()):
            break
        parent.rmdir()


# The flags a checked command may carry; a command with any other flag of Hydra's (--help, --cfg,
# a config dir, shell completion) goes to Hydra unchecked, as it is
_RUN_FLAGS = ("-m", "--multirun", "-r", "--run")
MAX_POINTS_CHECKED = 1024  # composing one takes ~10 ms


def cli() -> None:
    """fldp-train and `python -m fldp.train`: the config (every point of a sweep) is composed and
    checked before Hydra writes anything, so a config that cannot work, Hydra's own override
    errors included, exits 2 naming the key, and leaves no directory behind."""
    args = sys.argv[1:]
    if "--version" in args:  # fldp's, not Hydra's
        print(version_line())
        sys.exit(0)
    record_command(args)
    if not any(a.startswith("-") and a not in _RUN_FLAGS for a in args) and not launched():
        try:
            precheck([a for a in args if a not in _RUN_FLAGS], multirun=any(a in ("-m", "--multirun") for a in args))
        except ConfigError as e:
            print(f"fldp: config error: {e}", file=sys.stderr)
            sys.exit(2)
    try:
        main()
    except SystemExit as e:  # a sweep ended by a failed point: the points it submitted run on
        slurm.follow_submitted(wait=e.code not in (128 + signal.SIGINT, 128 + signal.SIGTERM))
        raise
    if slurm.follow_submitted():
        sys.exit(1)


# Variables fldp.launch.from_environment needs one of to find a launched rank (torchrun's RANK, a
# SLURM step's id): without them this process is none, said without importing torch with fldp.launch
LAUNCHER_VARIABLES = ("RANK", "SLURM_STEP_ID")


def launched() -> bool:
    """Whether this process is a rank of a world torchrun or srun started (the launcher checked it)."""
    if not any(v in os.environ for v in LAUNCHER_VARIABLES):
        return False
    from . import launch

    return launch.from_environment() is not None


def precheck(overrides: list[str], multirun: bool) -> None:
    """Compose the config as Hydra will (each point of a sweep over the command line's values, as
    Hydra's basic sweeper expands them); a single run is also validated, since Hydra would write
    its .hydra/ before run() refuses it. A sweep point with a bad value is left to fail alone, as
    it would in Hydra. Raises ConfigError."""
    global _new_run_dir
    parsed = parse_overrides(overrides)
    points = sweep_points(parsed) if multirun else [overrides]
    if points is None:  # a sweep this expansion cannot list (a glob over a group): Hydra's to check
        return
    cfg = compose_points(points, multirun)
    if multirun:
        return
    try:  # a hydra.run.dir made of Hydra's runtime values is known only once Hydra runs
        template = cast(dict, OmegaConf.to_container(cfg.hydra.run, resolve=False))["dir"]
        run_dir = str(cfg.hydra.run.dir)
    except OmegaConfBaseException:
        run_dir = None
    with open_dict(cfg):
        del cfg["hydra"]
    validate(cfg)
    if run_dir is not None:
        _new_run_dir = "${now:" in template or not Path(run_dir).exists()
        check_not_another_run(cfg.trainer.resume, run_dir)  # before Hydra writes its train.log into that directory


def parse_overrides(overrides: list[str]) -> list:
    """Hydra's parse of the command line's overrides; a SLURM launcher of Hydra's is refused."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise ConfigError(str(e)) from None
    for o in parsed:
        if o.key_or_group == "hydra/launcher" and str(o.value()).startswith(("submitit", "fldp_slurm")):
            raise ConfigError(
                f"{o.input_line}: SLURM runs take one path, cluster=slurm (or a site's cluster "
                "config), also for a multirun: `-m cluster=slurm ...` submits each point as its own "
                "job, skips finished points and requeues at the time limit (docs/slurm.md)"
            )
    return parsed


def sweep_points(parsed: list) -> list[tuple[str, ...]] | None:
    """A sweep's points (the first MAX_POINTS_CHECKED), each its overrides; None when this expansion
    cannot list them."""
    from hydra.errors import HydraException

    values = (
        [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] if o.is_sweep_override() else [o.input_line]
        for o in parsed
    )
    try:
        return list(itertools.islice(itertools.product(*values), MAX_POINTS_CHECKED))
    except HydraException:
        return None


def compose_points(points: list, multirun: bool):
    """Compose each point as Hydra will (its hydra config included); the last point's config. A key
    the config lacks is named by the schema, with the nearest key."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="train"):
        for point in points:
            try:
                cfg = compose("config", overrides=list(point), return_hydra_config=True)
            except (HydraException, OmegaConfBaseException) as e:
                where = f" (sweep point {' '.join(point)})" if multirun else ""
                if unknown := re.match(r"Could not override '([^']+)'", str(e)):
                    # composed with +, the schema names the unknown key and the nearest key
                    added = [f"+{o}" if o.split("=")[0] == unknown[1] else o for o in point]
                    with contextlib.suppress(HydraException, OmegaConfBaseException):
                        schema.check(compose("config", overrides=added))
                raise ConfigError(f"{e}{where}".replace("\n", " ")) from None
    return cfg


if __name__ == "__main__":
    cli()
