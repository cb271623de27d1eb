"""The paper's published numbers: the one place they are typed in is `paper_values.json`."""

from __future__ import annotations

import json
from pathlib import Path

PAPER_VALUES = Path(__file__).with_name("paper_values.json")


def load(path: str | Path | None = None) -> dict:
    return json.loads(Path(path or PAPER_VALUES).read_text())
