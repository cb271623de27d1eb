"""Data faults end before any worker starts, naming the file and the problem; a broken token cache
is made again. Each fault is made from the shipped corpus and tokenizer."""

import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
import threading

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
    for missing, says in (
        ("tokenizer.json", "cannot load a tokenizer"),
        ("tokenizer_config.json", "no end-of-sequence token (tokenizer_config.json is missing"),
    ):
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
    config["eos_token"] = next(
        t for t in vocab if t not in (config.get("eos_token"), config.get("bos_token")) and vocab[t] > 10
    )
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    cfg2 = compose_cfg(f"dataset.cache_dir={tmp_path / 'cache'}", f"dataset.tokenizer={other}")
    second = prepare(cfg2.dataset)
    assert second.cache != first.cache and not second.train.equal(first.train)


def test_the_cli_stops_before_any_worker(tmp_path):
    bad = tmp_path / "not_json.jsonl.gz"
    bad.write_bytes(FAULTS["not_json"][0])
    run_dir = tmp_path / "run"
    out = cli(
        f"dataset.data_files.train={bad}",
        f"dataset.cache_dir={tmp_path / 'cache'}",
        "trainer.steps=1",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 2 and f"dataset.data_files.train={bad}: cannot read" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert not run_dir.exists(), "a refused run left its directory (Hydra's .hydra/ and train.log)"


class ClosingHub:
    """A loopback stand-in for the hub that reads each request and closes the connection unanswered
    (as a broken proxy or firewall may), keeping the request lines: a client that retries shows."""

    def __init__(self):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.requests: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:  # closed: the test is over
                return
            with connection:
                connection.settimeout(10)
                try:
                    self.requests.append(connection.recv(4096).decode(errors="replace").split("\r\n")[0])
                except OSError:
                    self.requests.append("(no request)")

    def asked(self) -> list[str]:
        """The requests, less huggingface_hub's own fetch of its agent registry (once, never retried)."""
        return [r for r in self.requests if not r.startswith("GET /api/agent-harnesses ")]


@pytest.fixture
def closing_hub():
    hub = ClosingHub()
    yield hub
    hub.server.close()


@pytest.fixture
def closed_port():
    """A loopback port nothing listens on, held bound for the test (a port released could be
    taken, and answered, by another process): connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def run_clean_mc4_it(tmp_path, **env) -> subprocess.CompletedProcess:
    """dataset=clean_mc4_it with its path and tokenizer left at their hub ids (CLEAN_MC4_IT and
    LLAMA31_TOKENIZER unset), an empty Hugging Face cache, and `env`."""
    unset = {
        "CLEAN_MC4_IT",
        "LLAMA31_TOKENIZER",
        "HF_ENDPOINT",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_DATASETS_OFFLINE",
    }
    base = {k: v for k, v in os.environ.items() if k not in unset}
    base.update(HF_HOME=str(tmp_path / "hf"), FLDP_CACHE=str(tmp_path / "cache"), NO_PROXY="127.0.0.1", **env)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "fldp.train",
            "dataset=clean_mc4_it",
            "wandb.mode=disabled",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=base,
        timeout=300,
    )


TOKENIZER_REFUSED = "fldp: config error: dataset.tokenizer=meta-llama/Llama-3.1-8B: a hub id, but "
SET_TOKENIZER = (
    "the Hugging Face cache holds no copy of it: set LLAMA31_TOKENIZER (or dataset.tokenizer) to a "
    "local directory holding the tokenizer"
)


def test_offline_mode_refuses_a_hub_tokenizer_at_once_naming_it(tmp_path):
    out = run_clean_mc4_it(tmp_path, HF_HUB_OFFLINE="1")
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{TOKENIZER_REFUSED}HF_HUB_OFFLINE=1 (offline mode), and {SET_TOKENIZER}" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_unreachable_hub_refuses_a_hub_tokenizer_naming_it(tmp_path, closed_port):
    endpoint = closed_port
    out = run_clean_mc4_it(tmp_path, HF_ENDPOINT=endpoint)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{TOKENIZER_REFUSED}the hub cannot be reached at {endpoint} (ConnectionRefusedError" in out.stderr, (
        out.stderr[-2000:]
    )
    assert SET_TOKENIZER in out.stderr


def test_a_hub_that_does_not_answer_is_asked_once(tmp_path, closing_hub):
    """huggingface_hub retries a request left unanswered 5 times, backing off (~45 s in all): the
    tokenizer is refused after one request, fldp's question whether the hub answers."""
    out = run_clean_mc4_it(tmp_path, HF_ENDPOINT=closing_hub.url)
    assert closing_hub.asked() == ["HEAD / HTTP/1.1"], closing_hub.requests
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{TOKENIZER_REFUSED}the hub cannot be reached at {closing_hub.url}" in out.stderr, out.stderr[-2000:]


def test_a_hub_dataset_is_refused_after_one_request_when_the_hub_does_not_answer(tmp_path, closing_hub):
    """The tokenizer local, dataset.path the hub's (CLEAN_MC4_IT unset): datasets would retry too."""
    out = run_clean_mc4_it(tmp_path, HF_ENDPOINT=closing_hub.url, LLAMA31_TOKENIZER=str(SOURCE / "tokenizer"))
    assert closing_hub.asked() == ["HEAD / HTTP/1.1"], closing_hub.requests
    assert out.returncode == 2, out.stderr[-2000:]
    assert (
        f"fldp: config error: dataset.path=gsarti/clean_mc4_it: a hub dataset, but the hub cannot be reached at "
        f"{closing_hub.url}"
    ) in out.stderr, out.stderr[-2000:]
    assert "set CLEAN_MC4_IT (or dataset.path) to a local copy" in out.stderr
