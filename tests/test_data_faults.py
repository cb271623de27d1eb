"""Data faults end before any worker starts, naming the file and the problem; a broken token cache
is made again. Each fault is made from the shipped corpus and tokenizer."""
import gzip
import json
import shutil

import pytest

from conftest import ROOT, cli, compose_cfg
from fldp.data import cache_entry, load_tokenizer, prepare
from fldp.mesh import ConfigError

SOURCE = ROOT / "fldp" / "assets" / "diodati_1649"
RAW = (SOURCE / "train.jsonl.gz").read_bytes()
LINES = gzip.decompress(RAW).decode().splitlines()


def lines_with(extra: bytes) -> bytes:
    """The corpus with one bad line inserted after the 50th."""
    head, tail = "\n".join(LINES[:50]).encode(), "\n".join(LINES[50:]).encode()
    return gzip.compress(head + b"\n" + extra + b"\n" + tail + b"\n")


FAULTS = {  # name: (file bytes, what the error must say)
    "truncated": (RAW[: len(RAW) // 2], "Compressed file ended before the end-of-stream marker"),
    "corrupt": (RAW[:100] + b"\0" * 500 + RAW[600:], "Error -3 while decompressing"),
    "not_json": (lines_with(b"this is not JSON"), "JSON parse error"),
    "no_text": (lines_with(json.dumps({"book": "x"}).encode()), "document 51 of"),
    "not_utf8": (lines_with(b'{"text": "caf\xe9"}'), "UnicodeDecodeError"),
    "empty": (gzip.compress(b""), "no documents (an empty file or split)"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_broken_corpus_is_named(tmp_path, fault):
    data, says = FAULTS[fault]
    path = tmp_path / f"{fault}.jsonl.gz"
    path.write_bytes(data)
    cfg = compose_cfg(f"dataset.data_files.train={path}", f"dataset.cache_dir={tmp_path / 'cache'}")
    with pytest.raises(ConfigError) as e:
        prepare(cfg.dataset)
    assert says in str(e.value) and str(path) in str(e.value), str(e.value)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())  # nothing cached


def test_a_tokenizer_directory_missing_a_file_is_named(tmp_path):
    for missing, says in (("tokenizer.json", "cannot load a tokenizer"),
                          ("tokenizer_config.json", "no end-of-sequence token (tokenizer_config.json is missing")):
        tokenizer = tmp_path / f"without_{missing}"
        shutil.copytree(SOURCE / "tokenizer", tokenizer)
        (tokenizer / missing).unlink()
        with pytest.raises(ConfigError) as e:
            load_tokenizer(str(tokenizer))
        assert says in str(e.value) and f"dataset.tokenizer={tokenizer}" in str(e.value), str(e.value)


def test_a_truncated_token_cache_is_made_again(tmp_path):
    cfg = compose_cfg(f"dataset.cache_dir={tmp_path}")
    first = prepare(cfg.dataset)
    path, _ = cache_entry(cfg.dataset, load_tokenizer(str(cfg.dataset.tokenizer)))
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 3])
    again = prepare(cfg.dataset)
    assert again.train.equal(first.train) and path.read_bytes() == whole


def test_a_cache_of_another_tokenizer_is_not_used(tmp_path):
    """Same vocabulary and merges, but no EOS token id in the config -> refused; with another EOS
    id -> another cache file, not the first one's blocks."""
    cfg = compose_cfg(f"dataset.cache_dir={tmp_path / 'cache'}")
    first = prepare(cfg.dataset)
    other = tmp_path / "other_tokenizer"
    shutil.copytree(SOURCE / "tokenizer", other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    vocab = load_tokenizer(str(other)).get_vocab()
    config["eos_token"] = next(t for t in vocab if t not in (config.get("eos_token"), config.get("bos_token"))
                               and vocab[t] > 10)
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    cfg2 = compose_cfg(f"dataset.cache_dir={tmp_path / 'cache'}", f"dataset.tokenizer={other}")
    second = prepare(cfg2.dataset)
    assert second.cache != first.cache and not second.train.equal(first.train)


def test_the_cli_stops_before_any_worker(tmp_path):
    bad = tmp_path / "not_json.jsonl.gz"
    bad.write_bytes(FAULTS["not_json"][0])
    run_dir = tmp_path / "run"
    out = cli(f"dataset.data_files.train={bad}", f"dataset.cache_dir={tmp_path / 'cache'}", "trainer.steps=1",
              f"hydra.run.dir={run_dir}", cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and f"dataset.data_files.train={bad}: cannot read" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert not run_dir.exists(), "a refused run left its directory (Hydra's .hydra/ and train.log)"
