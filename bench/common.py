"""What every benchmark here shares: percentiles, timestamps, progress lines, results files."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def percentile(values: Iterable[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def stamp_seconds(stamp: Any) -> float:
    """A protobuf Timestamp as Unix seconds."""
    return float(stamp.ToNanoseconds()) / 1e9


def log(message: str) -> None:
    """A timestamped progress line on stderr (the results table goes to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def write_results(path: Path, results: dict[str, Any]) -> None:
    """The results file: strict JSON (no NaN, which strict parsers refuse), indented."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
