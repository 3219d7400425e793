"""Small helpers shared by the benchmarks in ``bench/``: load reporting, repeat statistics and the figure line.

Not a benchmark itself (``make bench`` runs ``bench/*.py`` only; this file lives one folder down).
"""

from __future__ import annotations

import os
import statistics
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass


def uptime() -> str:
    """The machine's ``uptime`` line (load averages over 1, 5, 15 min), falling back to ``os.getloadavg``."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        one, five, fifteen = os.getloadavg()
        return f"load average: {one:.2f}, {five:.2f}, {fifteen:.2f}"


def print_load(tag: str) -> None:
    """Print the load line with a tag (``start`` / ``end``) and the CPU count: figures are relative to it."""
    print(f"[load {tag}] {uptime()} (cpus: {os.cpu_count()})", flush=True)


@dataclass(frozen=True)
class Summary:
    """Median, min and max of repeated measurements (``n`` values, in the caller's unit)."""

    median: float
    min: float
    max: float
    n: int

    def fmt(self, digits: int = 3, unit: str = "") -> str:
        """``median [min .. max] unit (n=N)``."""
        u = f" {unit}" if unit else ""
        return f"{self.median:.{digits}f}{u} [min {self.min:.{digits}f}, max {self.max:.{digits}f}, n={self.n}]"


def summarize(values: Sequence[float]) -> Summary:
    """Median / min / max of ``values``.

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("no measurements to summarize")
    return Summary(statistics.median(values), min(values), max(values), len(values))


def figure_line(name: str, value: float, unit: str, anchor: str, anchor_value: float, ratio: float,
                digits: int = 2) -> str:
    """The final line every benchmark prints: ``name: value unit (anchor: value, ratio)``.

    ``anchor`` names what the figure is compared with (e.g. ``TRL 1.16 GRPOTrainer``, ``dd conv=fsync``);
    ``ratio`` is ours / anchor in the direction where higher is better for the named figure.
    """
    return f"{name}: {value:.{digits}f} {unit} ({anchor}: {anchor_value:.{digits}f} {unit}, {ratio:.2f}x)"
