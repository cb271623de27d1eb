"""Data: the shipped corpus, the block cutting, the per-rank slices, the clean_mc4_it loader."""

import pytest
import torch
from conftest import compose_cfg
from omegaconf import OmegaConf

from fldp import ASSETS
from fldp.data import RankBatches, load_tokenizer, prepare, tokenize_blocks
from fldp.mesh import ConfigError


def dataset_cfg(tmp_path, *overrides):
    return compose_cfg(*overrides, f"dataset.cache_dir={tmp_path}").dataset


def test_shipped_corpus_and_cache(tmp_path):
    cfg = dataset_cfg(tmp_path)
    blocks = prepare(cfg)
    assert blocks.vocab_size == 4096
    assert blocks.train.shape[1] == blocks.eval.shape[1] == 128
    assert len(blocks.train) > 7000 and len(blocks.eval) == 256
    assert int(blocks.train.max()) < blocks.vocab_size
    (cached,) = tmp_path.glob("diodati_1649-*.pt")
    again = prepare(cfg)
    assert torch.equal(again.train, blocks.train) and torch.equal(again.eval, blocks.eval)
    assert list(tmp_path.glob("*.pt")) == [cached]


def test_blocks_are_the_concatenated_documents():
    tok = load_tokenizer(str(ASSETS / "diodati_1649/tokenizer"))
    docs = ["Nel principio Iddio creò il cielo e la terra.", "E la luce fu.", "Amen."] * 5
    blocks = tokenize_blocks(tok, iter(docs), block_size=8, max_blocks=None, batch_docs=2)
    stream = [t for d in docs for t in tok(d)["input_ids"] + [tok.eos_token_id]]
    assert blocks.flatten().tolist() == stream[: len(blocks) * 8]
    assert len(blocks) == len(stream) // 8
    assert stream[0] == tok.bos_token_id
    assert len(tokenize_blocks(tok, iter(docs), 8, max_blocks=3)) == 3


def test_rank_slices_are_disjoint_and_seeded():
    blocks = torch.arange(100).view(100, 1)

    def epoch(rank, seed, world=4):
        return torch.cat(list(RankBatches(blocks, 3, rank, world, seed).epoch(0))).flatten().tolist()

    slices = [epoch(r, 42) for r in range(4)]
    seen = [i for s in slices for i in s]
    assert len(seen) == len(set(seen)) == 4 * (25 // 3) * 3  # disjoint, short batches dropped
    assert slices == [epoch(r, 42) for r in range(4)]  # deterministic from the seed
    assert slices != [epoch(r, 7) for r in range(4)]


def test_clean_mc4_it_loader_on_the_shipped_corpus(tmp_path):
    """The paper's loader (hub id or local path, fixed blocks, train/test counts) on local files."""
    cfg = dataset_cfg(tmp_path, "dataset=clean_mc4_it")
    assert (cfg.block_size, cfg.train_blocks, cfg.eval_blocks) == (2048, 65536, 4096)
    OmegaConf.update(
        cfg,
        "data_files",
        {
            "train": str(ASSETS / "diodati_1649/train.jsonl.gz"),
            "validation": str(ASSETS / "diodati_1649/validation.jsonl.gz"),
        },
    )
    cfg.path, cfg.tokenizer = "json", str(ASSETS / "diodati_1649/tokenizer")
    cfg.block_size, cfg.train_blocks, cfg.eval_blocks = 256, 100, 10
    blocks = prepare(cfg)
    assert blocks.train.shape == (100, 256) and blocks.eval.shape == (10, 256)


@pytest.mark.parametrize(
    "key,value,expected",
    [
        ("dataset.data_files.validation", "/missing/v.jsonl", "dataset.data_files.validation=/missing/v.jsonl"),
        ("dataset.tokenizer", "/missing/tok", "dataset.tokenizer=/missing/tok"),
        ("dataset.text_field", "body", "dataset.text_field=body"),
        ("dataset.block_size", "2000000", "dataset.train_split=train: no full block"),
    ],
)
def test_bad_data_is_named(tmp_path, key, value, expected):
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        prepare(dataset_cfg(tmp_path, f"{key}={value}"))
