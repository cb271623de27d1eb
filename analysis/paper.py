"""The paper's published numbers: the one place they are typed in is `paper_values.json`."""

from __future__ import annotations

import json
from pathlib import Path

PAPER_VALUES = Path(__file__).with_name("paper_values.json")


def load(path: str | Path | None = None) -> dict:
    return json.loads(Path(path or PAPER_VALUES).read_text())


def paper_ratio(paper: dict, num: str, den: str, metric: str = "eval_perplexity") -> float:
    """num / den in the paper's Table 3."""
    t3 = paper["table3"]
    col = t3["columns"].index(metric)
    return t3["rows"][num][col] / t3["rows"][den][col]
