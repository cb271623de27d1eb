"""Data: tokenise documents, concatenate, cut into fixed blocks; each rank reads a disjoint slice.

As the authors' code: documents are tokenised (BOS ... EOS), concatenated and cut into
`block_size`-token blocks; the first `train_blocks` train. A DistributedSampler over the whole
world (shuffle, seed, drop_last) gives every rank a disjoint slice. Tokenised blocks are cached on
disk, keyed by everything that shapes them, so the 8 local workers (or N ranks) do not re-tokenise.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

from .mesh import ConfigError


@dataclass
class Blocks:
    train: torch.Tensor  # (N, block_size) int32
    eval: torch.Tensor   # (M, block_size) int32
    vocab_size: int      # the tokenizer's, incl. special tokens


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    local = Path(path)
    if (path.startswith((".", "/", "~")) or local.exists()) and not local.expanduser().is_dir():
        raise ConfigError(f"dataset.tokenizer={path}: no such tokenizer directory")
    try:
        return AutoTokenizer.from_pretrained(str(local.expanduser()) if local.exists() else path)
    except Exception as e:  # hub id without network, or a broken directory
        raise ConfigError(f"dataset.tokenizer={path}: cannot load a tokenizer ({type(e).__name__}: {e})") from e


def _check_data_files(data_cfg) -> None:
    for split, path in (data_cfg.data_files or {}).items():
        if "://" not in str(path) and not any(c in str(path) for c in "*?[") and not Path(path).exists():
            raise ConfigError(f"dataset.data_files.{split}={path}: no such file")


def _source(data_cfg, split: str) -> str:
    """The key and value that name where a split comes from, for error messages."""
    files = data_cfg.data_files or {}
    return f"dataset.data_files.{split}={files[split]}" if split in files else f"dataset.path={data_cfg.path} (split {split})"


def _documents(data_cfg, split: str):
    from datasets import load_dataset

    files = dict(data_cfg.data_files) if data_cfg.data_files else None
    try:
        stream = iter(load_dataset(data_cfg.path, name=data_cfg.config_name, data_files=files,
                                   split=split, streaming=True))
        while True:
            try:
                row = next(stream)
            except StopIteration:
                return
            text = row.get(data_cfg.text_field)
            if text is None:
                raise ConfigError(f"dataset.text_field={data_cfg.text_field}: not a field of "
                                  f"{_source(data_cfg, split)} (fields: {sorted(row)})")
            yield text
    except ConfigError:
        raise
    except Exception as e:  # unreadable, corrupt, or not what the builder expects
        raise ConfigError(f"{_source(data_cfg, split)}: cannot read ({type(e).__name__}: {e})") from e


def tokenize_blocks(tokenizer, documents, block_size: int, max_blocks: int | None,
                    batch_docs: int = 512) -> torch.Tensor:
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
    n = len(tokens) // block_size if need is None else min(len(tokens) // block_size, max_blocks)
    return torch.tensor(tokens[: n * block_size], dtype=torch.int32).view(n, block_size)


def _cache_key(data_cfg, tokenizer) -> str:
    fields = {k: v for k, v in data_cfg.items() if k not in ("cache_dir", "name")}
    fingerprint = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()
    blob = json.dumps({"data": fields, "tokenizer": fingerprint}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def prepare(data_cfg) -> Blocks:
    """Tokenised train and eval blocks, from the cache when present. Raises ConfigError on bad
    paths, unknown fields or a corpus too small for one block, before any training starts."""
    if int(data_cfg.block_size) < 2:
        raise ConfigError(f"dataset.block_size={data_cfg.block_size}: must be >= 2")
    _check_data_files(data_cfg)
    tokenizer = load_tokenizer(str(data_cfg.tokenizer))
    cache = Path(os.path.expanduser(str(data_cfg.cache_dir))) / f"{data_cfg.name}-{_cache_key(data_cfg, tokenizer)}.pt"
    if cache.exists():
        saved = torch.load(cache, mmap=True)
        return Blocks(saved["train"], saved["eval"], saved["vocab_size"])
    splits = {}
    for key, split, limit in (("train", data_cfg.train_split, data_cfg.train_blocks),
                              ("eval", data_cfg.eval_split, data_cfg.eval_blocks)):
        splits[key] = tokenize_blocks(tokenizer, _documents(data_cfg, split), int(data_cfg.block_size), limit)
        if len(splits[key]) == 0:
            raise ConfigError(f"dataset.{key}_split={split}: no full block of {data_cfg.block_size} tokens "
                              f"in {_source(data_cfg, split)} (empty or too small corpus)")
    blocks = Blocks(splits["train"], splits["eval"], len(tokenizer))
    cache.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=cache.parent, delete=False, suffix=".tmp") as f:
        torch.save({"train": blocks.train, "eval": blocks.eval, "vocab_size": blocks.vocab_size}, f)
    os.replace(f.name, cache)  # atomic: a concurrent reader never sees half a file
    return blocks


class RankBatches:
    """This rank's batches: a disjoint, seeded slice of the blocks, `batch_size` per step.
    Epochs reshuffle (set_epoch); a short last batch is dropped."""

    def __init__(self, blocks: torch.Tensor, batch_size: int, rank: int, world: int,
                 seed: int, shuffle: bool = True):
        self.blocks, self.batch_size = blocks, batch_size
        self.sampler = DistributedSampler(range(len(blocks)), num_replicas=world, rank=rank,
                                          shuffle=shuffle, seed=seed, drop_last=True)
        self.per_epoch = len(self.sampler) // batch_size

    def epoch(self, epoch: int):
        self.sampler.set_epoch(epoch)
        indices = list(self.sampler)
        for i in range(self.per_epoch):
            yield self.blocks[indices[i * self.batch_size:(i + 1) * self.batch_size]].long()

    def stream(self, skip: int = 0):
        """Endless batches, epoch after epoch, starting after the first `skip` (a resumed run)."""
        epoch, offset = divmod(skip, self.per_epoch)
        while True:
            for i, batch in enumerate(self.epoch(epoch)):
                if i >= offset:
                    yield batch
            epoch, offset = epoch + 1, 0
