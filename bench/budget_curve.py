"""Perplexity against bits/weight: uniform widths and bits budgets (``weights.target_bits``) side by side.

    python -m bench.budget_curve bench/results/budget/rtn-w3.json bench/results/budget/rtn-mix3.json ... \
        [--out bench/results/budget/curve.json]

Reads rows written by ``bench/calibrated.py`` (each with its checkpoint's ``bits_per_weight``; a budget
row carries its ``budget`` record), keeps one point per row, and writes them as raw JSON plus a text
plot (``--plot``, matplotlib is not in the venv): for each protocol and text, perplexity against
bits/weight, ``u`` a uniform width and ``b`` a budget. Rows from files scored on different tokens
are refused: their perplexities do not compare.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bench.scoring import PROTOCOLS, commit

ROOT = Path(__file__).resolve().parent.parent


def points(files: list[Path]) -> tuple[list[dict], dict]:
    """One point per row of every file; the files' protocols, which must agree. A peer's row
    (``bench/peers.py`` records no bits/weight) takes the bits/weight of lowbit's rows of its width
    in the same files: the same scheme (group 64, asymmetric) in the same format."""
    out, protocols = [], None
    for file in files:
        data = json.loads(file.read_text())
        if "protocols" not in data:
            raise SystemExit(f"{file}: no 'protocols' record; it was written before bench/ scored both protocols "
                             "(issue 17 §0): re-run it with bench/calibrated.py")
        if protocols not in (None, data["protocols"]):
            raise SystemExit(f"{file}: scored on other tokens than the files before it ({data['protocols']})")
        protocols = data["protocols"]
        for row in data["rows"]:
            budget = row.get("budget")
            out.append({
                "kind": "float" if row["method"] == "float" else "budget" if budget else "uniform",
                "tool": row.get("tool", "lowbit"),
                "method": row["method"], "bits": row["bits"], "bits_per_weight": row.get("bits_per_weight"),
                "target_bits": budget and budget["target_bits"],
                "estimator": budget and budget.get("estimator", "output"),  # records before the Fisher had none
                "assignment": budget and _counts(budget), "estimated_loss": budget and budget["estimated_loss"],
                "quantize_s": row["quantize_s"], "commit": data["commit"], "file": os.path.relpath(file, ROOT),
                "ppl": {p: {t: s["ppl"] for t, s in texts.items()} for p, texts in row["scores"].items()},
            })
    _peer_bits_per_weight(out)
    records = [r["budget"] for f in files for r in json.loads(f.read_text())["rows"] if r.get("budget")]
    one_estimator = len({r.get("estimator", "output") for r in records}) == 1  # else the estimates do not compare
    for pt in out:  # the sensitivity pass's estimate for a uniform row too: does the estimate order the rows?
        if pt["kind"] == "uniform" and records and one_estimator:
            pt["estimated_loss"] = _uniform_estimate(records[0], pt)
    return sorted(out, key=lambda p: p["bits_per_weight"]), protocols


def _peer_bits_per_weight(pts: list[dict]) -> None:
    known = {p["bits"]: p["bits_per_weight"] for p in pts if p["kind"] == "uniform" and p["bits_per_weight"]}
    for p in pts:
        if p["bits_per_weight"] is None and p["kind"] != "float":
            if p["bits"] not in known:
                raise SystemExit(f"{p['file']}: row {p['tool']} {p['method']} records no bits/weight and no lowbit "
                                 f"row of {p['bits']} bits in these files gives one; add such a file")
            p["bits_per_weight"] = known[p["bits"]]


def _uniform_estimate(record: dict, pt: dict) -> float | None:
    """Summed sensitivity of every Linear at the row's one width (group 64, as bench/calibrated.py rows are)."""
    label = f"w{pt['bits']} g64"
    layers = record["layers"].values()
    return sum(e["loss"][label] for e in layers) if all(label in e["loss"] for e in layers) else None


def _counts(budget: dict) -> dict:
    counts = {}
    for entry in budget["layers"].values():
        counts[entry["choice"]] = counts.get(entry["choice"], 0) + 1
    return counts


def table(pts: list[dict]) -> str:
    keys = [(p, t) for p in PROTOCOLS for t in ("persuasion", "code")]
    lines = ["| row | bits/weight | " + " | ".join(f"{p}: {t}" for p, t in keys)
             + " | estimated loss | Linears per scheme |",
             "|---|---|" + "---|" * len(keys) + "---|---|"]
    for pt in pts:
        method = pt["method"].partition(":")[0]
        name = "float" if pt["kind"] == "float" else (
            f"budget {pt['target_bits']:.3f} {method} ({pt['estimator']})" if pt["kind"] == "budget"
            else f"uniform W{pt['bits']} {method}") + ("" if pt.get("tool", "lowbit") == "lowbit" else f" [{pt['tool']}]")
        mix = ", ".join(f"{k}: {v}" for k, v in sorted(pt["assignment"].items())) if pt["assignment"] else ""
        lines.append(f"| {name} | {pt['bits_per_weight']:.3f} | "
                     + " | ".join(f"{pt['ppl'][p][t]:.3f}" for p, t in keys)
                     + f" | {'' if pt['estimated_loss'] is None else format(pt['estimated_loss'], '.4g')} | {mix} |")
    return "\n".join(lines)


def text_plot(pts: list[dict], protocol: str, text: str, width: int = 56, height: int = 12) -> str:
    """Perplexity (rows, log scale) against bits/weight (columns); u uniform, b budget."""
    import math

    quantized = [p for p in pts if p["kind"] != "float"]
    xs = [p["bits_per_weight"] for p in quantized]
    ys = [math.log(p["ppl"][protocol][text]) for p in quantized]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    grid = [[" "] * (width + 1) for _ in range(height + 1)]
    for p, x, y in zip(quantized, xs, ys):
        col = round((x - x0) / ((x1 - x0) or 1) * width)
        row = height - round((y - y0) / ((y1 - y0) or 1) * height)
        grid[row][col] = "b" if p["kind"] == "budget" else "u"
    top, bottom = math.exp(y1), math.exp(y0)
    lines = [f"{protocol} protocol, {text}: perplexity (log scale) against bits/weight; u uniform, b budget"]
    for i, row in enumerate(grid):
        label = f"{top:8.2f} |" if i == 0 else f"{bottom:8.2f} |" if i == height else "         |"
        lines.append(label + "".join(row))
    lines.append("         +" + "-" * (width + 1))
    lines.append(f"          {x0:<8.3f}" + " " * (width - 16) + f"{x1:>8.3f}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "budget" / "curve.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "bench" / "results" / "budget" / "curve.txt")
    args = ap.parse_args()
    pts, protocols = points([f.resolve() for f in args.files])
    args.out.write_text(json.dumps({"made_by": "bench/budget_curve.py", "commit": commit(), "protocols": protocols,
                                    "points": pts}, indent=2))
    plots = [text_plot(pts, p, t) for p in PROTOCOLS for t in ("persuasion", "code")]
    args.plot.write_text(table(pts) + "\n\n" + "\n\n".join(plots) + "\n")
    print(args.plot.read_text())


if __name__ == "__main__":
    main()
