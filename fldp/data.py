"""Data: tokenise documents, concatenate, cut into fixed blocks; each rank reads a disjoint slice.

As the authors' code: documents are tokenised (BOS ... EOS), concatenated and cut into
`block_size`-token blocks; the first `train_blocks` train. A DistributedSampler over the whole
world (shuffle, seed, drop_last) gives every rank a disjoint slice. Tokenised blocks are cached on
disk, keyed by everything that shapes them, so the 8 local workers (or N ranks) do not re-tokenise.

The cache file records what it was made from (`made_from`: the dataset settings, the tokenizer's
fingerprint, the size and modification time of every local source file) and its name is a hash of
that, so a changed source or tokenizer is a miss. A file whose record disagrees (renamed, copied,
corrupt) is stale: `prepare` (local runs, `python -m fldp.data`) makes it again, with a warning;
the SLURM pre-flight (fldp/preflight.py) refuses it, so no job tokenises on its nodes.

`python -m fldp.data [overrides]` makes the cache of a run's dataset here (a login node), with the
same Hydra overrides as `python -m fldp.train`, and prints where it is and its block counts.
"""

from __future__ import annotations

import glob
import hashlib
import http.client
import json
import logging
import os
import re
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from omegaconf import OmegaConf
from torch.utils.data import DistributedSampler

from .mesh import ConfigError

log = logging.getLogger("fldp")


@dataclass
class Blocks:
    train: torch.Tensor  # (N, block_size) int32
    eval: torch.Tensor  # (M, block_size) int32
    vocab_size: int  # the tokenizer's, incl. special tokens
    cache: Path | None = None  # the file they were read from or saved to


def looks_local(path: str) -> bool:
    """A filesystem path, rather than a hub id or a `datasets` builder name."""
    return path.startswith((".", "/", "~")) or Path(path).expanduser().exists()


# Hugging Face's offline switches: the hub's (transformers and datasets read it too) and each library's
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
HUB_PROBE_TIMEOUT_S = 10


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be used from here (offline mode, or no answer to one request),
    None if it answers. Asked once, without retries: huggingface_hub retries a request that fails
    to connect 5 times, backing off (~45 s), before a run could say why it cannot start. urllib, as
    huggingface_hub, takes its proxies from HTTPS_PROXY/HTTP_PROXY/NO_PROXY."""
    for name in OFFLINE_VARIABLES:
        if os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return f"{name}={os.environ[name]} (offline mode)"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")  # as huggingface_hub reads it
    try:
        with urllib.request.urlopen(
            urllib.request.Request(f"{endpoint}/", method="HEAD"), timeout=HUB_PROBE_TIMEOUT_S
        ) as response:
            status = response.status
    except urllib.error.HTTPError as e:  # an answer all the same
        status = e.code
    except (OSError, http.client.HTTPException) as e:  # no route, refused, DNS, TLS, closed unanswered
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        return f"the hub cannot be reached at {endpoint} ({type(reason).__name__}: {reason})"
    return f"the hub at {endpoint} answers HTTP {status}" if status >= 500 else None


def env_variable(node, key: str) -> str | None:
    """The environment variable the config reads `key` from, e.g. CLEAN_MC4_IT; None if none."""
    m = re.search(r"oc\.env:(\w+)", str(cast(dict, OmegaConf.to_container(node, resolve=False)).get(key)))
    return m.group(1) if m else None


def where_to_set(data_cfg, key: str) -> str:
    """'CLEAN_MC4_IT (or dataset.path)': what a user sets to give dataset.<key> another value."""
    name = env_variable(data_cfg, key) if OmegaConf.is_config(data_cfg) else None
    return f"{name} (or dataset.{key})" if name else f"dataset.{key}"


def load_tokenizer(path: str, setting: str = "dataset.tokenizer"):
    """The tokenizer of a local directory or a hub id; with the hub out of reach, a hub id only from
    Hugging Face's cache. `setting` names what to set instead (where_to_set)."""
    from transformers import AutoTokenizer

    local = Path(path)
    if looks_local(path) and not local.expanduser().is_dir():
        raise ConfigError(f"dataset.tokenizer={path}: no such tokenizer directory")
    hub_down = None if looks_local(path) else hub_unreachable()
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(local.expanduser()) if local.exists() else path, local_files_only=hub_down is not None
        )
    except Exception as e:  # a broken directory, a hub id the hub lacks, or no network
        if hub_down:
            raise ConfigError(
                f"dataset.tokenizer={path}: a hub id, but {hub_down}, and the Hugging Face cache "
                f"holds no copy of it: set {setting} to a local directory holding the tokenizer"
            ) from e
        raise ConfigError(f"dataset.tokenizer={path}: cannot load a tokenizer ({type(e).__name__}: {e})") from e
    if tokenizer.eos_token_id is None:  # documents are concatenated with EOS between them
        config = local.expanduser() / "tokenizer_config.json"
        hint = f" ({config.name} is missing from the directory)" if local.exists() and not config.exists() else ""
        raise ConfigError(
            f"dataset.tokenizer={path}: the tokenizer has no end-of-sequence token{hint}, so "
            f"documents would run together"
        )
    return tokenizer


def is_url(path: str) -> bool:
    return "://" in path


def is_glob(path: str) -> bool:
    return any(c in path for c in "*?[")


def _check_data_files(data_cfg) -> None:
    from .corpus import CORPORA  # a corpus built by fldp-corpus: say how to build it

    for split, path in (data_cfg.data_files or {}).items():
        if not is_url(str(path)) and not is_glob(str(path)) and not Path(path).exists():
            build = f"fldp-corpus {data_cfg.name} --out {Path(path).parent}" if data_cfg.name in CORPORA else None
            fix = f"; build it with `{build}`" if build else ""
            raise ConfigError(f"dataset.data_files.{split}={path}: no such file{fix}")


def local_files(path: str) -> list[Path]:
    """The local files a dataset.data_files entry names: itself, or what its glob matches; none for
    a URL or a file that does not exist."""
    if is_url(path):
        return []
    if is_glob(path):
        return sorted(Path(p) for p in glob.glob(os.path.expanduser(path)) if Path(p).is_file())
    return [p] if (p := Path(path).expanduser()).is_file() else []


def _source(data_cfg, split: str) -> str:
    """The key and value that name where a split comes from, for error messages."""
    files = data_cfg.data_files or {}
    key = "dataset.train_split" if split == data_cfg.train_split else "dataset.eval_split"
    if split in files:
        return f"dataset.data_files.{split}={files[split]}"
    return f"dataset.path={data_cfg.path} ({key}={split})"


def _documents(data_cfg, split: str):
    from datasets import load_dataset

    files = dict(data_cfg.data_files) if data_cfg.data_files else None
    source, field, count = _source(data_cfg, split), data_cfg.text_field, 0
    try:
        stream = load_dataset(data_cfg.path, name=data_cfg.config_name, data_files=files, split=split, streaming=True)
        for count, row in enumerate(stream, 1):
            text = row.get(field)
            if text is None:  # absent from the file, or from this one document
                where = f"document {count} of {source} has none" if field in row else f"not a field of {source}"
                raise ConfigError(f"dataset.text_field={field}: {where} (fields: {sorted(row)})")
            yield text
    except ConfigError:
        raise
    except StopIteration:  # datasets' json builder raises it on a file with no line at all
        pass
    except Exception as e:  # unreadable, truncated, corrupt, not JSON, not UTF-8
        via = f" as dataset.path={data_cfg.path}" if data_cfg.data_files else ""  # the builder may be the wrong one
        raise ConfigError(f"{source}: cannot read{via} ({type(e).__name__}: {e})") from e
    if count == 0:
        raise ConfigError(f"{source}: no documents (an empty file or split)")


def tokenize_blocks(
    tokenizer, documents, block_size: int, max_blocks: int | None, batch_docs: int = 512
) -> torch.Tensor:
    """Concatenate tokenised documents and cut full blocks; stops reading once max_blocks are full."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    need = None if max_blocks is None else max_blocks * block_size
    tokens: list[int] = []
    batch: list[str] = []

    def flush():
        for ids in tokenizer(batch, add_special_tokens=True)["input_ids"]:
            tokens.extend(ids + eos)
        batch.clear()

    for doc in documents:
        batch.append(doc)
        if len(batch) == batch_docs:
            flush()
            if need is not None and len(tokens) >= need:
                break
    if batch:
        flush()
    n = len(tokens) // block_size if max_blocks is None else min(len(tokens) // block_size, max_blocks)
    return torch.tensor(tokens[: n * block_size], dtype=torch.int32).view(n, block_size)


def _stat(path: Path, name: str) -> list:
    st = path.stat()
    return [name, st.st_size, st.st_mtime_ns]


def source_fingerprint(data_cfg):
    """Name, size and modification time of every local file the blocks are read from: the
    data_files, or the files of a local dataset.path directory (hidden ones and the cache itself
    left out). None for a hub dataset, which cannot be fingerprinted from here."""
    if data_cfg.data_files:
        return {
            split: [_stat(p, str(p)) for p in local_files(str(path))] for split, path in data_cfg.data_files.items()
        }
    root = Path(str(data_cfg.path)).expanduser()
    if not root.is_dir():
        return None
    cache_dir = Path(os.path.expanduser(str(data_cfg.cache_dir))).resolve()
    files = (
        p
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
        and not p.resolve().is_relative_to(cache_dir)
    )
    return [_stat(p, str(p.relative_to(root))) for p in files]


def _tokenizer_fingerprint(tokenizer) -> str:
    """The backend (vocabulary, merges, post-processor) and the special tokens the config adds."""
    special = json.dumps([type(tokenizer).__name__, tokenizer.bos_token_id, tokenizer.eos_token_id])
    return hashlib.sha256((tokenizer.backend_tokenizer.to_str() + special).encode()).hexdigest()


def cache_entry(data_cfg, tokenizer) -> tuple[Path, dict]:
    """The cache file of these blocks and what it is made from (stored in it; its name hashes it).
    JSON-normalised, so that it compares equal to what a file recorded."""
    fields = cast(dict, OmegaConf.to_container(data_cfg, resolve=True))
    made_from = json.loads(
        json.dumps(
            {
                "data": {k: v for k, v in fields.items() if k not in ("cache_dir", "name")},
                "tokenizer": _tokenizer_fingerprint(tokenizer),
                "source": source_fingerprint(data_cfg),
            },
            sort_keys=True,
            default=str,
        )
    )
    key = hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()[:16]
    return Path(os.path.expanduser(str(data_cfg.cache_dir))) / f"{data_cfg.name}-{key}.pt", made_from


class StaleCache(ConfigError):
    """A cache file that holds blocks made from something else than what is asked."""


def _differences(recorded, expected: dict) -> str:
    if not isinstance(recorded, dict):
        return "it records nothing of what it was made from (an older fldp wrote it)"
    data = recorded.get("data") or {}
    out = [
        f"dataset.{k}={data.get(k)!r} (now {expected['data'].get(k)!r})"
        for k in sorted(set(data) | set(expected["data"]))
        if data.get(k) != expected["data"].get(k)
    ]
    if recorded.get("tokenizer") != expected["tokenizer"]:
        out.append("another tokenizer")
    if recorded.get("source") != expected["source"]:
        out.append("other source files (names, sizes or modification times differ)")
    return "it was made from " + ", ".join(out or ["something else"])


def read_cache(path: Path, made_from: dict) -> dict | None:
    """The saved blocks in `path`, None if there is no such file; StaleCache, naming the file and
    what differs, when it was not made from `made_from` or cannot be read."""
    if not path.exists():
        return None
    try:
        saved = torch.load(path, mmap=True)  # mmap: the blocks are read only when used
        recorded = json.loads(saved["made_from"]) if "made_from" in saved else None
    except Exception as e:  # truncated or not a cache file
        raise StaleCache(f"dataset.cache_dir: {path} cannot be read ({type(e).__name__}: {e})") from e
    if recorded != made_from:
        raise StaleCache(
            f"dataset.cache_dir: {path} does not match this dataset and tokenizer: {_differences(recorded, made_from)}"
        )
    return saved


def prepare(data_cfg) -> Blocks:
    """Tokenised train and eval blocks, from the cache when present. Raises ConfigError on bad
    paths, unknown fields or a corpus too small for one block, before any training starts."""
    if int(data_cfg.block_size) < 2:
        raise ConfigError(f"dataset.block_size={data_cfg.block_size}: must be >= 2")
    _check_data_files(data_cfg)
    tokenizer = load_tokenizer(str(data_cfg.tokenizer), where_to_set(data_cfg, "tokenizer"))
    cache, made_from = cache_entry(data_cfg, tokenizer)
    try:
        saved = read_cache(cache, made_from)
    except StaleCache as e:  # here the data is at hand: make it again (the SLURM pre-flight refuses it)
        log.warning("%s; tokenising again", e)
        saved = None
    if saved is not None:
        return Blocks(saved["train"], saved["eval"], saved["vocab_size"], cache)
    check_hub_dataset(data_cfg)
    splits = {}
    for key, split, limit in (
        ("train", data_cfg.train_split, data_cfg.train_blocks),
        ("eval", data_cfg.eval_split, data_cfg.eval_blocks),
    ):
        splits[key] = tokenize_blocks(tokenizer, _documents(data_cfg, split), int(data_cfg.block_size), limit)
        if len(splits[key]) == 0:
            raise ConfigError(
                f"dataset.{key}_split={split}: no full block of dataset.block_size={data_cfg.block_size} tokens "
                f"in {_source(data_cfg, split)} (empty or too small corpus)"
            )
    blocks = Blocks(splits["train"], splits["eval"], len(tokenizer), cache)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=cache.parent, delete=False, suffix=".tmp") as f:
        torch.save(
            {
                "train": blocks.train,
                "eval": blocks.eval,
                "vocab_size": blocks.vocab_size,
                "made_from": json.dumps(made_from),
            },
            f,
        )
    os.replace(f.name, cache)  # atomic: a concurrent reader never sees half a file
    return blocks


def check_hub_dataset(data_cfg) -> None:
    """A dataset.path that names a hub dataset is streamed from the hub: refused at once if the hub
    is out of reach (datasets would retry for ~45 s first)."""
    path = str(data_cfg.path)
    if data_cfg.data_files or looks_local(path):  # with data_files, dataset.path is a builder (json, ...)
        return
    if hub_down := hub_unreachable():
        raise ConfigError(
            f"dataset.path={path}: a hub dataset, but {hub_down}: set {where_to_set(data_cfg, 'path')} "
            f"to a local copy (a directory of its data files)"
        )


class RankBatches:
    """This rank's batches: a disjoint, seeded slice of the blocks, `batch_size` per step.
    Epochs reshuffle (set_epoch); a short last batch is dropped."""

    def __init__(self, blocks: torch.Tensor, batch_size: int, rank: int, world: int, seed: int, shuffle: bool = True):
        self.blocks, self.batch_size = blocks, batch_size
        self.sampler: DistributedSampler = DistributedSampler(
            range(len(blocks)),  # type: ignore[arg-type]  # a sized sequence is all it reads
            num_replicas=world,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=True,
        )
        self.per_epoch = len(self.sampler) // batch_size

    def epoch(self, epoch: int):
        self.sampler.set_epoch(epoch)
        indices = list(self.sampler)
        for i in range(self.per_epoch):
            yield self.blocks[indices[i * self.batch_size : (i + 1) * self.batch_size]].long()

    def stream(self, skip: int = 0):
        """Endless batches, epoch after epoch, starting after the first `skip` (a resumed run)."""
        epoch, offset = divmod(skip, self.per_epoch)
        while True:
            for i, batch in enumerate(self.epoch(epoch)):
                if i >= offset:
                    yield batch
            epoch, offset = epoch + 1, 0


class WorldBatches:
    """Every rank's RankBatches at once, [world, batch_size, block]: rank r's row is what RankBatches
    gives rank r, step by step (the simulator, fldp/simulate.py). DistributedSampler draws one
    permutation per epoch from (seed, epoch) alone, keeps the first world * (n // world) indices
    (drop_last) and deals them round-robin (rank r takes r, r + world, ...): made once here, not once
    per rank (512 python lists of 65k indices per epoch took most of a paper-shaped step)."""

    def __init__(self, blocks: torch.Tensor, batch_size: int, world: int, seed: int, shuffle: bool = True):
        self.blocks, self.batch_size, self.world = blocks, batch_size, world
        self.sampler: DistributedSampler = DistributedSampler(
            range(len(blocks)),  # type: ignore[arg-type]  # a sized sequence is all it reads
            num_replicas=1,
            rank=0,
            shuffle=shuffle,
            seed=seed,
        )
        self.per_rank = len(blocks) // world
        self.per_epoch = self.per_rank // batch_size

    def epoch(self, epoch: int):
        self.sampler.set_epoch(epoch)
        order = torch.tensor(list(self.sampler))[: self.per_rank * self.world].view(self.per_rank, self.world).T
        for i in range(self.per_epoch):
            yield self.blocks[order[:, i * self.batch_size : (i + 1) * self.batch_size]].long()

    def stream(self):
        """Endless batches, epoch after epoch."""
        epoch = 0
        while True:
            yield from self.epoch(epoch)
            epoch += 1


def main() -> None:
    """`python -m fldp.data [overrides]`: the run's token cache, made here once (a login node with
    the data at hand) so that a SLURM job only reads it; prints where it is and its block counts."""
    import sys

    import hydra

    # a preparation, not a run: no output directory, no log file (as fldp.cost)
    sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]

    from . import CONF

    @hydra.main(config_path=str(CONF), config_name="config", version_base="1.3")
    def _run(cfg) -> None:
        d = cfg.dataset
        try:
            blocks = prepare(d)
        except ConfigError as e:
            print(f"fldp: config error: {e}", file=sys.stderr)
            sys.exit(2)
        print(
            f"{blocks.cache}\ndataset {d.name}: {len(blocks.train)} train and {len(blocks.eval)} eval blocks "
            f"of {d.block_size} tokens (asked: {d.train_blocks or 'all'} and {d.eval_blocks or 'all'}), "
            f"vocabulary {blocks.vocab_size}"
        )

    _run()


if __name__ == "__main__":
    main()
