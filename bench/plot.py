"""Perplexity against bits/weight, one SVG per (protocol, text), from any result files of ``bench/calibrated.py``.

    python -m bench.plot bench/results/quality/w3-peers.json bench/results/budget/rtn-*.json \
        [--out-prefix bench/results/quality/ppl-vs-bits]

Every quantized row is one point (x: the checkpoint's bits/weight, scales and zero points included; a
peer's row takes lowbit's bits/weight at its width, ``bench.budget_curve.points``); rows of one tool and
method at different widths are joined into a line, and the rows of a bits budget (``weights.target_bits``)
of one method and sensitivity into the budget curve. The float model is a dashed line. The y axis is
logarithmic: 2-bit rows can sit orders of magnitude above the rest. Writes
``<out-prefix>-<protocol>-<text>.svg``; the files must be scored on the same tokens (refused otherwise).
Hand-written SVG (``evals.report``'s axes), no plotting library.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from bench.budget_curve import points
from bench.scoring import PROTOCOLS
from evals.svg import COLORS, H, PAD, W, axes, esc, legend, padded, scale

ROOT = Path(__file__).resolve().parent.parent


def series_name(pt: dict) -> str:
    """One line per tool and method; a budget's rows differ only in their target, so its target is dropped."""
    name, _, options = pt["method"].partition(":")
    kept = [o for o in options.split(",") if o and not o.startswith("weights.target_bits=")]
    method = name + (":" + ",".join(kept) if kept else "")
    estimator = f", {pt['estimator']}" if pt.get("estimator") else ""
    return f"{pt['tool']} {method}" + (f" (bits budget{estimator})" if pt["kind"] == "budget" else "")


def svg(pts: list[dict], protocol: str, text: str) -> str:
    """The chart of one protocol and text: log-y perplexity against bits/weight."""
    quantized = [p for p in pts if p["kind"] != "float"]
    floats = [p["ppl"][protocol][text] for p in pts if p["kind"] == "float"]
    series: dict[str, list[dict]] = {}
    for p in sorted(quantized, key=lambda p: p["bits_per_weight"]):
        series.setdefault(series_name(p), []).append(p)
    labels = list(series) + [f"float: {v:.2f}" for v in floats]
    xs = padded([p["bits_per_weight"] for p in quantized])
    ys = padded([math.log10(p["ppl"][protocol][text]) for p in quantized] + [math.log10(v) for v in floats])
    sx, sy = scale(*xs, PAD, W - 16), scale(*ys, H - PAD, 24)
    out = axes(f"{protocol} protocol, {text}", "bits per weight (quantized Linears)", "perplexity (log scale)",
                xs, ys, f"ppl-vs-bits-{protocol}-{text}", len(labels), ylog=True)
    for i, (name, members) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        coords = [(sx(p["bits_per_weight"]), sy(math.log10(p["ppl"][protocol][text]))) for p in members]
        if len(coords) > 1:
            dash = ' stroke-dasharray="5 3"' if members[0]["kind"] == "budget" else ""
            out.append(f'<polyline points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in coords)}" fill="none" '
                       f'stroke="{color}" stroke-width="1.5"{dash}/>')
        for p, (x, y) in zip(members, coords):
            mark = (f'<rect class="point" x="{x - 4:.1f}" y="{y - 4:.1f}" width="8" height="8"' if p["kind"] == "budget"
                    else f'<circle class="point" cx="{x:.1f}" cy="{y:.1f}" r="4"')
            out.append(f'{mark} fill="{color}"><title>{esc(name)}: {p["ppl"][protocol][text]:.3f} at '
                       f'{p["bits_per_weight"]:.3f} bits/weight ({esc(p["file"])})</title></{mark.split()[0][1:]}>')
    for j, value in enumerate(floats):
        color = COLORS[(len(series) + j) % len(COLORS)]
        y = sy(math.log10(value))
        out.append(f'<line x1="{PAD}" y1="{y:.1f}" x2="{W - 16}" y2="{y:.1f}" stroke="{color}" stroke-dasharray="2 3"/>')
    out += legend(labels) + ["</svg>"]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--out-prefix", default=str(ROOT / "bench" / "results" / "quality" / "ppl-vs-bits"))
    args = ap.parse_args()
    pts, _ = points([f.resolve() for f in args.files])
    texts = sorted({t for p in pts for t in p["ppl"][next(iter(PROTOCOLS))]})
    for protocol in PROTOCOLS:
        for text in texts:
            path = Path(f"{args.out_prefix}-{protocol}-{text}.svg")
            path.write_text(svg(pts, protocol, text) + "\n")
            print(path)


if __name__ == "__main__":
    main()
