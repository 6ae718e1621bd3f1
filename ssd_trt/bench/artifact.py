"""A benchmark's artifact: its JSON, the PNG drawn from it, and the table printed from it."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable


def write_artifact(result: dict[str, Any], out: Path, plot: Callable[[dict[str, Any], Path], Path | None],
                   table: Callable[[dict[str, Any]], str]) -> None:
    """``result`` as JSON at ``out``, ``plot``'s PNG beside it (when matplotlib is there), ``table`` printed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    png = plot(result, out.with_suffix(".png"))
    print(table(result))
    print(f"wrote {out}" + (f" and {png}" if png else ""), file=sys.stderr)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed (the PNGs are optional)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
