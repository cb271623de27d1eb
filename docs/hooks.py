"""MkDocs hook (mkdocs.yml `hooks:`): the pages MkDocs cannot find in docs/.

- `reference/config.md`, the configuration reference, generated from `fldp/schema.py` by
  `fldp.schema_doc.reference_markdown()` at every build;
- the repository files a page shows (REPO_FILES: the tiny reproduction's figure), at their path in
  the repository. A page links them as the repository lays them out (`../experiments/...` from
  docs/), so the link works on GitHub too; the site's copy is at `experiments/...`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
REPO_FILES = ("experiments/tiny_repro/figure2.png",)


def _reference() -> str:
    # This checkout's fldp, not one installed from another one
    if sys.path[:1] != [str(ROOT)]:
        sys.path.insert(0, str(ROOT))
    from fldp.schema_doc import reference_markdown

    return reference_markdown()


def on_files(files, config):
    files.append(File.generated(config, "reference/config.md", content=_reference()))
    for rel in REPO_FILES:
        files.append(File.generated(config, rel, abs_src_path=str(ROOT / rel)))
    return files


def on_page_markdown(markdown, page, config, files):
    depth = page.file.src_uri.count("/")  # docs/ itself: 0
    for rel in REPO_FILES:
        markdown = markdown.replace(f"]({'../' * (depth + 1)}{rel})", f"]({'../' * depth}{rel})")
    return markdown
