"""What defines an experiment, as opposed to how it is run.

A configuration is its mathematics and its timings: the algorithm and mesh, model, data, trainer,
optimiser, FSDP policy and emulated network. Resuming, checkpointing, progress bars, W&B, the
cluster, output directories, where the data and tokenizer are read from, the init device (fldp.init
gives the same weights either way), the byte meter (which costs under 1%) and elastic federation
(which acts only once a group fails) change none of that.
The analysis labels configurations by the defining keys only, and the dry run compares a run with the
paper's setting through them."""

from __future__ import annotations

from dataclasses import asdict

from . import CONF
from .config import Config, load

# config sections that define an experiment (the seed is the replicate index, not a configuration)
SECTIONS = ("algorithm", "mesh", "model", "trainer", "optimizer", "fsdp", "comm")
DATASET_KEYS = ("name", "block_size", "train_blocks", "eval_blocks", "text_field")
# keys inside those sections that control a run but not what it computes
OPERATIONAL = frozenset(
    {
        "trainer.progress",
        "trainer.resume",
        "trainer.skip_finished",
        "trainer.checkpoint_every",
        "trainer.keep_last",
        "trainer.async_save",
        "comm.measure",
        "model.init_device",
        # what happens after a group fails; without a failure an elastic run computes the same, bit for
        # bit (tests/test_elastic.py)
        "algorithm.elastic",
    }
)


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def defining(config: dict) -> dict:
    """The flattened keys of a config (a plain dict, resolved or not) that define the experiment."""
    picked = {s: config[s] for s in SECTIONS if isinstance(config.get(s), dict)}
    data = config.get("dataset") or {}
    picked["dataset"] = {k: data[k] for k in DATASET_KEYS if k in data}
    picked["topology"] = {"name": (config.get("topology") or {}).get("name")}
    flat = flatten(picked)
    # one fragment, sent and taken at once, is the whole model's aggregation, as without streaming
    if (
        flat.get("algorithm.streaming.fragments", 1) == 1
        and not flat.get("algorithm.streaming.overlap")
        and not flat.get("algorithm.streaming.alpha")
    ):
        flat = {k: v for k, v in flat.items() if not k.startswith("algorithm.streaming.")}
    # the default, as runs recorded before the key existed say by lacking it
    if flat.get("model.activation_checkpointing") == "none":
        del flat["model.activation_checkpointing"]
    return {k: v for k, v in flat.items() if k not in OPERATIONAL}


def differences(conf: Config, reference: Config) -> list[str]:
    """`key=value (paper: value)` for each defining key on which two configs differ; a whole other
    model or dataset is named once (`model=tiny_llama`), not key by key."""
    mine, theirs = (defining(asdict(c)) for c in (conf, reference))
    keys = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    other = {k.split(".")[0] for k in keys if k in ("model.name", "dataset.name")}
    return [
        f"{k.removesuffix('.name')}={mine.get(k)!r} (paper: {theirs.get(k)!r})"
        for k in keys
        if k.split(".")[0] not in other or k.endswith(".name")
    ]


def paper_config(algorithm: str, topology: str) -> Config:
    """What `algorithm=ALGORITHM topology=TOPOLOGY` composes with nothing else: for a topology that
    is a paper setting (leonardo_512), the paper's run."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = [f"algorithm={algorithm}", f"topology={topology}"]
    if GlobalHydra.instance().is_initialized():  # inside `python -m fldp.train`: the app's own search path
        return load(compose("config", overrides=overrides))
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return load(compose("config", overrides=overrides))
