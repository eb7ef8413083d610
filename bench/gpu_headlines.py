"""The table bench/gpu_check.py prints last: per stage, its headline lines (targets with measured
values, or check counts), each speed figure with the torch and Triton versions that made it."""

from __future__ import annotations

import collections
import math

ENGINE_TARGETS = {"w4_itl_vs_fp16": 2.8, "w4_int4kv_itl_vs_fp16": 3.0, "bandwidth_floor_fraction": 0.7}


def _engine_headlines(record: dict, copy_bw: float | None) -> list[dict]:
    batch1 = {r["config"]: r for r in record["engine"] if r.get("batch") == 1 and "mode" not in r}
    out = []

    def itl(config):
        r = batch1.get(config)
        return r and r["itl_s"]["mean"]

    for config, key in (("w4g128", "w4_itl_vs_fp16"), ("w4g128+kv-int4", "w4_int4kv_itl_vs_fp16")):
        if itl(config) and itl("fp16"):
            ratio = itl("fp16") / itl(config)
            out.append({"target": f"{config} batch-1 ITL >= {ENGINE_TARGETS[key]}x faster than fp16 "
                                  f"(prompt {batch1[config]['prompt_len']})",
                        "measured": round(ratio, 3), "met": ratio >= ENGINE_TARGETS[key]})
    for config, r in batch1.items():
        if copy_bw and r.get("bytes_per_step") and r["itl_s"]["mean"]:
            frac = r["bytes_per_step"] / copy_bw / r["itl_s"]["mean"]
            goal = ENGINE_TARGETS["bandwidth_floor_fraction"]
            out.append({"target": f"{config} batch-1 ITL >= {goal:.0%} of the bandwidth floor",
                        "measured": round(frac, 3), "met": frac >= goal})
    hf = {(r["batch"], r["prompt_len"]): r["output_tokens_per_s"] for r in record.get("transformers", [])}
    for r in record["engine"]:
        base = hf.get((r.get("batch"), r.get("prompt_len")))
        if base:
            ratio = r["output_tokens_per_s"] / base
            out.append({"target": f"{r['config']} batch {r['batch']} prompt {r['prompt_len']} ahead of "
                                  "transformers fp16 (tok/s)",
                        "measured": round(ratio, 3), "met": ratio > 1.0})
    return out


def headlines(stages: dict) -> dict:
    """Per stage: the lines of the table (targets with measured values, or check counts); a stage
    that failed or was cut has its error's last line too, after whatever it measured before."""
    copy_bw = stages.get("env", {}).get("ceilings", {}).get("copy_bytes_per_s")
    out = {}
    for name, s in stages.items():
        try:
            out[name] = _stage_lines(name, s, copy_bw)
        except (KeyError, TypeError):  # nothing measured (the stage died first)
            out[name] = []
        if "versions" in s:  # a speed figure is read with the stack that made it
            for line in out[name]:
                line["versions"] = f"torch {s['versions']['torch']}, triton {s['versions']['triton']}"
        if "error" in s:
            out[name].append({"target": "stage ran", "measured": s["error"].strip().splitlines()[-1][:160],
                              "met": False})
    return out


def _stage_lines(name: str, s: dict, copy_bw: float | None) -> list[dict]:
    if name == "env":
        c, v = s["ceilings"], s["versions"]
        return [{"target": "ceilings", "measured": f"copy {c['copy_bytes_per_s'] / 1e9:.0f} GB/s, matmul "
                                                   f"{c['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s", "met": None},
                {"target": "stack", "measured": f"torch {v['torch']}, triton {v['triton']}, numpy {v['numpy']}",
                 "met": None},
                {"target": "absent optional packages", "measured": ", ".join(s.get("absent_packages", {})) or "none",
                 "met": None}]
    if name in ("weights", "attention", "engine"):
        good = s["cases"] - len([r for r in s["results"] if not r["passed"]])
        worst = f", worst rel. error {s['worst_rel_error']:.1e}" if "worst_rel_error" in s else ""
        return [{"target": "cases correct", "measured": f"{good}/{s['cases']}{worst}", "met": s["passed"]}]
    if name == "tests":
        absent = sum(skip["tests"] for skip in s.get("skipped_for_absent_packages", []))
        return [{"target": "pytest", "measured": ", ".join(f"{n} {k}" for k, n in s["counts"].items())
                 + (f" ({absent} for absent {', '.join(s.get('absent_packages', {}))})" if absent else ""),
                 "met": s["passed"]}]
    if name == "kernel-speed":
        return s["record"].get("targets", []) + _peer_headlines(s["record"]) + _winner_headlines(s["record"])
    if name == "attention-speed":
        return s["record"].get("targets", [])
    if name == "engine-speed":
        return _engine_headlines(s["record"], copy_bw)
    return []


def _peer_headlines(record: dict) -> list[dict]:
    """Per row count M: our speed-up over cuBLAS fp16 and over PyTorch's int4 kernel, as the geometric
    mean over the shapes where both ran (no target: the peer is there to read ours against)."""
    lines = []
    for M in sorted({r["M"] for r in record.get("ratios", [])}):
        for peer in ("torch_fp16", "torch_int4"):
            got = [r[f"vs_{peer}"] for r in record["ratios"] if r["M"] == M and r.get(f"vs_{peer}")]
            if got:
                mean = math.exp(sum(math.log(v) for v in got) / len(got))
                lines.append({"target": f"M={M} vs {peer.replace('_', '-')} (geomean of {len(got)} shapes)",
                              "measured": round(mean, 3), "met": None})
    return lines


def _winner_headlines(record: dict) -> list[dict]:
    """Per row count from 2 to 16: which kind of launch the tuner chose, over the shapes (the few-row
    GEMV against the 16-row tl.dot tile by its stages: bench/results/gpu/NOTES.md, "Small M")."""
    lines = []
    for M in sorted({r["M"] for r in record.get("results", []) if 1 < r["M"] <= 16}):
        kinds = collections.Counter(
            (f"gemv-rows {c['block_m']}x{c['block_n']}" if not c["use_dot"] else
             f"tl.dot {c['block_m']}x{c['block_n']} {c['num_stages']} stages")
            for r in record["results"] if r["M"] == M and r["impl"] == "lowbit" and (c := r.get("config")))
        if kinds:
            lines.append({"target": f"M={M} tuned launches", "met": None,
                          "measured": ", ".join(f"{kind} x{n}" for kind, n in kinds.most_common())})
    return lines


def summary_table(record: dict, names: list[str]) -> str:
    versions = next((s["versions"] for s in record["stages"].values() if "versions" in s), None)
    lines = [f"gpu_check on {record['device']}, commit {record['commit']}"
             + (f", torch {versions['torch']}, triton {versions['triton']}" if versions else "")
             + (" (SMOKE: CPU interpreter, no timing means anything)" if record.get("smoke") else ""),
             f"{'stage':<16} {'result':<6} {'wall':>7}  headline",
             "-" * 100]
    for name in names:
        s = record["stages"][name]
        heads = record["headlines"].get(name) or [{"target": "no targets (smoke, or none measured)",
                                                   "measured": "-", "met": None}]
        for i, h in enumerate(heads):
            met = "" if h["met"] is None else ("  [met]" if h["met"] else "  [NOT met]")
            left = f"{name:<16} {'pass' if s.get('passed') else 'FAIL':<6} {s['wall_s']:>6.0f}s" if i == 0 else " " * 31
            measured = f"{h['measured']:.3g}" if isinstance(h["measured"], float) else h["measured"]
            lines.append(f"{left}  {h['target']}: {measured}{met}")
    return "\n".join(lines)
