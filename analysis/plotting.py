"""matplotlib for files only (no display on CI or a cluster node): the one place the backend is set."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plt", "save"]


def save(fig, path: Path | str, dpi: int) -> None:
    """Writes the figure and frees it (pyplot keeps every open figure)."""
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
