"""Hand-written SVG plots: axes, ticks, legend (no plotting library; reports stay self-contained).

Shared by ``evals.report`` (the run report's plots) and ``bench/plot.py`` (perplexity against
bits per weight across result files).
"""

from __future__ import annotations

import html

W, H, PAD = 520, 300, 56
LEGEND_ROW = 15
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


def esc(x) -> str:
    return html.escape(str(x), quote=True)


def scale(lo: float, hi: float, a: float, b: float):
    span = (hi - lo) or 1.0
    return lambda v: a + (v - lo) / span * (b - a)


def ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    return [lo + (hi - lo) * i / n for i in range(n + 1)]


def axes(title: str, xlabel: str, ylabel: str, xs: tuple[float, float], ys: tuple[float, float], kind: str,
          legend_lines: int = 0, ylog: bool = False) -> list[str]:
    """An SVG with axes, ticks and labels; ``legend_lines`` rows of legend go below the x-axis label.
    With ``ylog`` the y range is log10 of the values and the ticks are labelled with the values."""
    sx, sy = scale(*xs, PAD, W - 16), scale(*ys, H - PAD, 24)
    height = H + LEGEND_ROW * legend_lines
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" data-plot="{kind}" width="{W}" height="{height}" '
           f'viewBox="0 0 {W} {height}" role="img" aria-label="{esc(title)}">',
           f'<rect x="0" y="0" width="{W}" height="{height}" fill="#fff"/>',
           f'<text x="{W / 2}" y="16" text-anchor="middle" font-size="13" font-weight="bold">{esc(title)}</text>',
           f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - 16}" y2="{H - PAD}" stroke="#333"/>',
           f'<line x1="{PAD}" y1="{H - PAD}" x2="{PAD}" y2="24" stroke="#333"/>',
           f'<text x="{(PAD + W - 16) / 2}" y="{H - 14}" text-anchor="middle" font-size="12">{esc(xlabel)}</text>',
           f'<text x="14" y="{H / 2}" text-anchor="middle" font-size="12" transform="rotate(-90 14 {H / 2})">{esc(ylabel)}</text>']
    for v in ticks(*xs):
        out.append(f'<text x="{sx(v):.1f}" y="{H - PAD + 16}" text-anchor="middle" font-size="10">{v:.3g}</text>')
    for v in ticks(*ys):
        label = 10 ** v if ylog else v
        out.append(f'<text x="{PAD - 4}" y="{sy(v) + 3:.1f}" text-anchor="end" font-size="10">{label:.3g}</text>')
        out.append(f'<line x1="{PAD}" y1="{sy(v):.1f}" x2="{W - 16}" y2="{sy(v):.1f}" stroke="#eee"/>')
    return out


def padded(values: list[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.1 or abs(hi) * 0.1 or 1.0
    return lo - pad, hi + pad


def legend(labels: list[str]) -> list[str]:
    """One row per label under the plot (long labels never cover the data)."""
    out = []
    for i, label in enumerate(labels):
        y = H + 4 + LEGEND_ROW * i
        out.append(f'<rect x="{PAD}" y="{y - 9}" width="10" height="10" fill="{COLORS[i % len(COLORS)]}"/>')
        out.append(f'<text x="{PAD + 14}" y="{y}" font-size="11">{esc(label)}</text>')
    return out
