"""Runs side by side: the run format ``lowbit eval --json`` writes, and the report built from several runs.

A run (format 2) is the eval result plus what makes its numbers comparable:
``format``, ``device``, ``versions``, ``commit``, the perplexity ``protocol``, a
``memory`` breakdown, and optionally ``speed`` (TTFT/ITL by batch) and ``tasks``
(lm-eval). ``lowbit report RUN... --out DIR`` writes ``report.json``,
``report.md`` and ``report.html`` (self-contained: inline SVG plots, no scripts,
nothing fetched).
"""

from __future__ import annotations

import json
from pathlib import Path

from evals.provenance import RUN_FORMAT, describe_device
from evals.svg import COLORS, H, PAD, W, axes, esc, legend, padded, scale

REQUIRED = ("format", "model", "ppl", "bits_per_weight", "protocol", "device", "versions", "commit")
KV_REFERENCE_CONTEXT = 4096  # the memory plot shows one sequence's KV cache at this context


class ReportError(ValueError):
    pass


# ----------------------------------------------------------------- run format

def memory_summary(ckpt_dir: Path, kv_scheme=None) -> dict:
    """Weights by kind (as stored) and KV bytes per token of every scheme, from headers and config only."""
    from evals import planner, size
    from kvquant import KVScheme, bytes_per_token, parse_kv

    stats = size.weight_stats(ckpt_dir)
    config = planner.text_config(json.loads((Path(ckpt_dir) / "config.json").read_text()))
    layers, kv_heads, head_dim = planner.attention_shape(config)
    kv_scheme = kv_scheme or KVScheme()
    per_token = {}
    for name in planner.DEFAULT_SCHEMES:
        s = parse_kv(name)
        per_token[s.name] = bytes_per_token(s, layers, kv_heads, head_dim, planner.KV_DTYPE)
    return {
        "quantized_weight_bytes": stats.quantized_bytes,
        "other_weight_bytes": stats.other_bytes,
        "kv_scheme": kv_scheme.name,
        "kv_bytes_per_token": per_token,
        "kv_dtype": str(planner.KV_DTYPE).replace("torch.", ""),
        "attention": {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim},
    }


def _load_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path}: not a lowbit eval run (a JSON object is expected)")
    return data


def run_files(spec: str | Path) -> list[Path]:
    """A run JSON, or every ``*.json`` in a run directory."""
    path = Path(spec)
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        if not files:
            raise ReportError(f"{path}: no run JSON in this directory (write one with `lowbit eval CKPT --json FILE`)")
        return files
    if not path.exists():
        raise ReportError(f"{path}: no such file or directory")
    return [path]


def load_run(path: Path) -> dict:
    """A run, checked: an older format or a JSON that is not a run says so and how to remake it."""
    data = _load_json(path)
    if "ppl" not in data or "model" not in data:
        raise ReportError(f"{path}: not a lowbit eval run (no 'model'/'ppl'); write runs with `lowbit eval CKPT --json FILE`")
    fmt = data.get("format", 1)
    missing = [k for k in REQUIRED if k not in data]
    if fmt < RUN_FORMAT or missing:
        raise ReportError(
            f"{path}: a run in an older format (format {fmt}, this lowbit reads {RUN_FORMAT}; missing "
            f"{', '.join(missing) or 'nothing'}): its numbers do not say which device and commit produced them. "
            f"Re-run `lowbit eval {data.get('model', 'CKPT')} --json {path.name}` to remake it")
    if fmt > RUN_FORMAT:
        raise ReportError(f"{path}: format {fmt} is newer than this lowbit reads ({RUN_FORMAT}); upgrade lowbit")
    data["_source"] = str(path)
    return data


def load_runs(specs) -> list[dict]:
    runs = [load_run(f) for spec in specs for f in run_files(spec)]
    if not runs:
        raise ReportError("no runs given")
    return runs


# -------------------------------------------------------------------- numbers

def _label(run: dict) -> str:
    return run.get("label") or Path(str(run["model"])).name or str(run["model"])


def _kv_bytes(run: dict) -> float:
    mem = run.get("memory") or {}
    return mem.get("kv_bytes_per_token", {}).get(mem.get("kv_scheme"), 0.0) * KV_REFERENCE_CONTEXT


def summary_rows(runs: list[dict]) -> list[dict]:
    rows = []
    for r in runs:
        mem = r.get("memory") or {}
        rows.append({
            "label": _label(r), "model": r["model"], "ppl": r["ppl"], "baseline_ppl": r.get("baseline_ppl"),
            "delta_ppl_pct": r.get("delta_ppl_pct"), "bits_per_weight": r["bits_per_weight"],
            "bytes_on_disk": r.get("bytes_on_disk"), "kv_scheme": mem.get("kv_scheme"),
            "weights_bytes": (mem.get("quantized_weight_bytes") or 0) + (mem.get("other_weight_bytes") or 0) or None,
            "device": describe_device(r["device"]), "commit": r["commit"], "protocol": r["protocol"].get("description"),
        })
    return rows


def build_report(runs: list[dict]) -> dict:
    from evals.provenance import provenance

    return {"format": RUN_FORMAT, "report_provenance": provenance(), "kv_reference_context": KV_REFERENCE_CONTEXT,
            "summary": summary_rows(runs), "runs": runs}


# ------------------------------------------------------------------- markdown

def _fmt(x, spec: str = ".4f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:.1f} MB"


def report_markdown(rep: dict) -> str:
    lines = ["# lowbit report", "", "| run | perplexity | Δ vs baseline | bits/weight | weights | on disk | KV cache | device | commit |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in rep["summary"]:
        delta = "-" if s["delta_ppl_pct"] is None else f"{s['delta_ppl_pct']:+.2f}%"
        lines.append(f"| {s['label']} | {_fmt(s['ppl'])} | {delta} | {_fmt(s['bits_per_weight'], '.2f')} | "
                     f"{_mb(s['weights_bytes'])} | {_mb(s['bytes_on_disk'])} | {s['kv_scheme'] or '-'} | "
                     f"{s['device']} | {s['commit']} |")
    lines += ["", "Protocols:"] + [f"- {s['label']}: {s['protocol']}" for s in rep["summary"]]
    speed = _speed_rows(rep["runs"])
    if speed:
        lines += ["", "## Speed by phase", "", "| " + " | ".join(SPEED_HEADERS) + " |", "|---" * len(SPEED_HEADERS) + "|"]
        lines += ["| " + " | ".join(str(c) for c in _speed_cells(label, t)) + " |" for label, t in speed]
        lines += ["", f"Speed protocol: {_speed_protocol(rep['runs'])}"]
    tasks = _task_rows(rep["runs"])
    if tasks:
        lines += ["", "## Tasks (lm-eval)", "", "| run | task | metric | value |", "|---|---|---|---|"]
        lines += [f"| {label} | {task} | {metric} | {value:.4f} |" for label, task, metric, value in tasks]
    lines += ["", "## Provenance", ""]
    for r in rep["runs"]:
        v = r["versions"]
        lines.append(f"- {_label(r)}: {describe_device(r['device'])}; commit {r['commit']}; "
                     + ", ".join(f"{k} {val}" for k, val in v.items()) + f"; from {r['_source']}")
    return "\n".join(lines) + "\n"


SPEED_HEADERS = ["run", "batch", "prompt", "output", "KV", "TTFT ms", "prefill tok/s", "ITL ms", "decode tok/s",
                 "peak memory"]


def _speed_cells(label: str, t: dict) -> list:
    peak = t.get("peak_memory_bytes")
    return [label, t["batch"], t["prompt_len"], t["output_len"], t["kv"], f"{t['ttft_s'] * 1e3:.1f}",
            f"{t['prefill_tokens_per_s']:,.0f}", f"{t['itl_s'] * 1e3:.1f}", f"{t['decode_tokens_per_s']:,.1f}", _mb(peak)]


def _speed_rows(runs) -> list[tuple[str, dict]]:
    return [(_label(r), t) for r in runs for t in (r.get("speed") or {}).get("rows", [])]


def _speed_protocol(runs) -> str:
    return next(((r.get("speed") or {}).get("protocol") for r in runs if r.get("speed")), "")


def _task_rows(runs) -> list[tuple[str, str, str, float]]:
    rows = []
    for r in runs:
        for task, metrics in ((r.get("tasks") or {}).get("tasks") or {}).items():
            for key, value in metrics.items():
                if "stderr" in key or key == "sample_len" or not isinstance(value, (int, float)):
                    continue
                rows.append((_label(r), task, key.split(",")[0], float(value)))
    return rows


# ------------------------------------------------------------------------ SVG plots

def svg_ppl_vs_bits(rep: dict) -> str:
    points = [(s["bits_per_weight"], s["ppl"], s["label"]) for s in rep["summary"]]
    bases = {(r.get("baseline"), r.get("baseline_ppl"), r.get("baseline_bits_per_weight")) for r in rep["runs"]
             if r.get("baseline_ppl") is not None and r.get("baseline_bits_per_weight") is not None}
    seen = {(round(x, 3), round(y, 4)) for x, y, _ in points}  # a baseline that is also a run is drawn once
    points += [(bits, ppl, f"{name} (baseline)") for name, ppl, bits in sorted(bases, key=str)
               if (round(bits, 3), round(ppl, 4)) not in seen]
    xs, ys = padded([p[0] for p in points]), padded([p[1] for p in points])
    sx, sy = scale(*xs, PAD, W - 16), scale(*ys, H - PAD, 24)
    out = axes("Perplexity vs bits per weight", "bits per weight (quantized Linears)", "perplexity", xs, ys,
                "ppl-vs-bits", len(points))
    for i, (x, y, label) in enumerate(points):
        out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="5" fill="{COLORS[i % len(COLORS)]}">'
                   f'<title>{esc(label)}: {y:.4f} at {x:.2f} bits</title></circle>')
    out += legend([p[2] for p in points]) + ["</svg>"]
    return "\n".join(out)


def svg_memory(rep: dict) -> str:
    """Stacked bars per run: quantized weights, other weights, one sequence's KV cache at the reference context."""
    parts = ("quantized weights", "other weights", f"KV, {KV_REFERENCE_CONTEXT} tokens")
    rows = []
    for r in rep["runs"]:
        mem = r.get("memory") or {}
        rows.append((_label(r), [mem.get("quantized_weight_bytes", 0), mem.get("other_weight_bytes", 0), _kv_bytes(r)]))
    top = max(sum(v) for _, v in rows) or 1.0
    bar_h = min(28, (H - PAD - 40) / max(len(rows), 1) - 6)
    sx = scale(0, top, 150, W - 60)  # room for the total after the longest bar
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" data-plot="memory" width="{W}" height="{H}" '
           f'viewBox="0 0 {W} {H}" role="img" aria-label="Memory breakdown">',
           f'<rect x="0" y="0" width="{W}" height="{H}" fill="#fff"/>',
           f'<text x="{W / 2}" y="16" text-anchor="middle" font-size="13" font-weight="bold">Memory breakdown (MB)</text>']
    for i, (label, values) in enumerate(rows):
        y, x = 36 + i * (bar_h + 6), 150.0
        out.append(f'<text x="144" y="{y + bar_h / 2 + 4:.1f}" text-anchor="end" font-size="10">{esc(label)}</text>')
        for j, v in enumerate(values):
            w = sx(v) - 150
            out.append(f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{bar_h:.1f}" '
                       f'fill="{COLORS[j]}"><title>{esc(parts[j])}: {v / 1e6:.1f} MB</title></rect>')
            x += w
        out.append(f'<text x="{x + 4:.1f}" y="{y + bar_h / 2 + 4:.1f}" font-size="10">{sum(values) / 1e6:.1f}</text>')
    for j, part in enumerate(parts):
        out.append(f'<rect x="{60 + j * 150}" y="{H - 24}" width="10" height="10" fill="{COLORS[j]}"/>')
        out.append(f'<text x="{74 + j * 150}" y="{H - 15}" font-size="10">{esc(part)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def svg_speed(rep: dict, key: str, title: str) -> str | None:
    """TTFT or ITL (ms) against batch size, one line per run and (prompt, output) workload."""
    series: dict[str, list[tuple[int, float]]] = {}
    for label, t in _speed_rows(rep["runs"]):
        name = f"{label} p{t['prompt_len']}/o{t['output_len']} {t['kv']}"
        series.setdefault(name, []).append((t["batch"], t[key] * 1e3))
    if not series:
        return None
    xs = padded([b for pts in series.values() for b, _ in pts])
    ys = (0.0, max(v for pts in series.values() for _, v in pts) * 1.15 or 1.0)
    sx, sy = scale(*xs, PAD, W - 16), scale(*ys, H - PAD, 24)
    out = axes(title, "batch size", "ms", xs, ys, key, len(series))
    for i, (name, pts) in enumerate(series.items()):
        pts = sorted(pts)
        color = COLORS[i % len(COLORS)]
        coords = " ".join(f"{sx(b):.1f},{sy(v):.1f}" for b, v in pts)
        out.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"/>')
        out += [f'<circle cx="{sx(b):.1f}" cy="{sy(v):.1f}" r="3.5" fill="{color}"><title>{esc(name)} batch {b}: '
                f'{v:.1f} ms</title></circle>' for b, v in pts]
    out += legend(list(series)) + ["</svg>"]
    return "\n".join(out)


# ----------------------------------------------------------------------- HTML

def _table(headers: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


CSS = ("body{font-family:system-ui,sans-serif;margin:24px;color:#222}table{border-collapse:collapse;margin:8px 0 20px}"
       "td,th{border:1px solid #ccc;padding:4px 8px;font-size:13px;text-align:right}th{background:#f3f3f3}"
       "td:first-child,th:first-child{text-align:left}.plots{display:flex;flex-wrap:wrap;gap:16px}"
       "svg.plot{border:1px solid #ddd}.note{color:#555;font-size:13px}")


def report_html(rep: dict) -> str:
    summary = [[s["label"], _fmt(s["ppl"]), "-" if s["delta_ppl_pct"] is None else f"{s['delta_ppl_pct']:+.2f}%",
                _fmt(s["bits_per_weight"], ".2f"), _mb(s["weights_bytes"]), _mb(s["bytes_on_disk"]),
                s["kv_scheme"] or "-", s["device"], s["commit"]] for s in rep["summary"]]
    plots = [svg_ppl_vs_bits(rep), svg_memory(rep), svg_speed(rep, "ttft_s", "Time to first token by batch"),
             svg_speed(rep, "itl_s", "Inter-token latency by batch")]
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>lowbit report</title><style>{CSS}</style></head><body>",
             "<h1>lowbit report</h1>",
             _table(["run", "perplexity", "Δ vs baseline", "bits/weight", "weights", "on disk", "KV cache", "device", "commit"], summary),
             "<div class='plots'>" + "".join(p for p in plots if p) + "</div>",
             "<p class='note'>Perplexity protocols: " + "; ".join(esc(f"{s['label']}: {s['protocol']}") for s in rep["summary"])
             + f". The memory plot shows weights as stored and one sequence of {KV_REFERENCE_CONTEXT} tokens in the "
               "run's KV scheme (its unquantized part in 16 bits); peak memory in the speed table is measured (CPU: the "
               "process's peak resident set, which includes any dequantized weight copies).</p>"]
    speed = _speed_rows(rep["runs"])
    if speed:
        parts += ["<h2>Speed by phase</h2>",
                  _table(SPEED_HEADERS, [_speed_cells(label, t) for label, t in speed]),
                  f"<p class='note'>Speed protocol: {esc(_speed_protocol(rep['runs']))}</p>"]
    tasks = _task_rows(rep["runs"])
    if tasks:
        parts += ["<h2>Tasks (lm-eval)</h2>", _table(["run", "task", "metric", "value"],
                                                     [[a, b, c, f"{v:.4f}"] for a, b, c, v in tasks])]
    parts += ["<h2>Provenance</h2>", _table(
        ["run", "device", "commit", "versions", "source"],
        [[_label(r), describe_device(r["device"]), r["commit"], ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
          r["_source"]] for r in rep["runs"]]), "</body></html>"]
    return "\n".join(parts)


def write_report(specs, out_dir: Path) -> dict[str, Path]:
    rep = build_report(load_runs(specs))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": out_dir / "report.json", "markdown": out_dir / "report.md", "html": out_dir / "report.html"}
    files["json"].write_text(json.dumps(rep, indent=2))
    files["markdown"].write_text(report_markdown(rep))
    files["html"].write_text(report_html(rep))
    return files


def complete_run(result: dict, ckpt: str, device: str = "cpu", speed: dict | None = None,
                 tasks: dict | None = None) -> dict:
    """An eval result made a run: provenance, memory breakdown, the baseline's bits/weight, speed and tasks."""
    from evals import size
    from evals.provenance import provenance
    from kvquant import kv_scheme_from_dict
    from quant import checkpoint, models
    from runtime.load import kv_scheme_of

    ckpt_dir = models.resolve(ckpt)
    run = {**result, **provenance(device)}
    ran_with = result.get("kv_cache")  # the KV scheme of a KV-perplexity run, else the checkpoint's own
    if isinstance(ran_with, dict):
        scheme = kv_scheme_from_dict({k: v for k, v in ran_with.items() if k != "name"})
    else:
        scheme = kv_scheme_of(checkpoint.read_manifest(ckpt_dir), None)
    run["memory"] = memory_summary(ckpt_dir, scheme)
    if result.get("baseline"):
        run["baseline_bits_per_weight"] = size.weight_stats(models.resolve(result["baseline"])).bits_per_weight
    if speed is not None:
        run["speed"] = speed
    if tasks is not None:
        run["tasks"] = tasks
    return run
