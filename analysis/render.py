"""Numeric tables (from `tables`) to text: "mean ± std" cells, Markdown, LaTeX, CSV."""

from __future__ import annotations

import math

import pandas as pd

HEADERS3 = {
    "train_perplexity": "train perplexity",
    "train_time_s": "train time [s]",
    "eval_perplexity": "eval perplexity",
    "eval_time_s": "eval time [s]",
}
HEADERS4 = {p: p for p in ("forward", "backward", "optimizer", "aggregation", "overall")}
_LATEX_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\^{}",
}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(c, c) for c in str(text))


def cell(mean: float, std: float = math.nan, seed_std: float = math.nan, decimals: int = 2, tex: bool = False) -> str:
    """'m ± s', or just 'm' when there is no spread to show (one value); '[± t]' appends the
    spread across seeds where it differs from the first one (Table 4)."""
    pm = r" $\pm$ " if tex else " ± "
    text = f"{mean:.{decimals}f}"
    if not math.isnan(std):
        text += f"{pm}{std:.{decimals}f}"
    if not math.isnan(seed_std):
        text += f" [{pm.strip()} {seed_std:.{decimals}f}]"
    return text


def cells(table: pd.DataFrame, headers: dict, decimals: int, tex: bool = False) -> pd.DataFrame:
    """One string per cell; columns: algorithm, seeds, then `headers`' names."""
    text = lambda s: latex_escape(s) if tex else s
    out = pd.DataFrame({"algorithm": table["label"].map(text), "seeds": table["seeds"].astype(int)})
    for key, header in headers.items():
        std = table.get(f"{key}_std", pd.Series(math.nan, index=table.index))
        seed_std = table.get(f"{key}_seed_std", pd.Series(math.nan, index=table.index))
        out[text(header)] = [cell(m, s, t, decimals, tex) for m, s, t in zip(table[f"{key}_mean"], std, seed_std)]
    return out


def _numeric(col: pd.Series) -> bool:
    return all(str(v)[:1].isdigit() or str(v)[:1] == "-" or str(v) in ("", "n/a") for v in col)


def markdown(df: pd.DataFrame) -> str:
    """A GitHub Markdown table: text left, numbers right."""
    cols = list(df.columns)
    esc = lambda v: str(v).replace("|", r"\|")
    lines = [
        "| " + " | ".join(esc(c) for c in cols) + " |",
        "|" + "|".join("---:" if i and _numeric(df[c]) else ":---" for i, c in enumerate(cols)) + "|",
    ]
    lines += ["| " + " | ".join(esc(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def latex(df: pd.DataFrame, caption: str, label: str) -> str:
    """A booktabs table; cells are already LaTeX (escaped text, $\\pm$)."""
    return df.to_latex(
        index=False,
        escape=False,
        column_format="l" + "r" * (len(df.columns) - 1),
        caption=latex_escape(caption),
        label=label,
        position="htbp",
    )
