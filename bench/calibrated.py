"""lowbit's calibrated methods against RTN, the float model and llm-compressor, in one run.

    python bench/calibrated.py [--methods float rtn gptq awq awq+gptq] \
        [--peer-python /tmp/lcvenv/bin/python --peer-methods gptq awq] [--out bench/results/calibrated-cpu.json]

Protocol of the GPTQ/AWQ issue: SmolLM2-135M, 4-bit, group 64, asymmetric,
lm_head kept; 128 x 512 calibration tokens from the bundled non-evaluation
Austen novels (seed 0); perplexity on the bundled Persuasion (16,384 tokens)
and, as a genre the calibration never saw, Python source (8,192 tokens), both
with window 1,024 / stride 512 (`bench/scoring.py`). A method may carry GPTQ settings
(``weights.gptq`` of the recipe): ``gptq:actorder=group,mse_clip=true``.

Every row runs in a fresh child process, one after another, so its wall time
and peak RSS are its own. Wall time covers the whole job: loading the model,
calibrating, quantizing and (lowbit) saving the checkpoint. The peers' rows
run `bench/peers.py` under ``--peer-python``, an environment with
llm-compressor (never a lowbit dependency):

    python -m venv /tmp/lcvenv && /tmp/lcvenv/bin/pip install torch==2.13.0 'llmcompressor==0.14.*'
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.scoring import commit, peak_rss_bytes, score_texts  # noqa: E402

SCHEME = {"bits": 4, "group_size": 64, "symmetric": False}


def one(method: str) -> dict:
    """Quantize with lowbit (or load the float model for ``float``) and score it."""
    import runtime
    from lowbit import pipeline
    from lowbit.recipe import parse_recipe
    from quant.models import resolve

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        if method == "float":
            path, seconds = resolve("smollm2-135m"), None
        else:
            name, _, options = method.partition(":")  # gptq:mse_clip=true,dampening=0.1 sets weights.gptq
            gptq = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in options.split(",") if o)}
            recipe = parse_recipe({"model": "smollm2-135m", "output": f"{tmp}/ckpt", "dtype": "bfloat16",
                                   "weights": {"method": name, **SCHEME, **({"gptq": gptq} if gptq else {})}})
            path = pipeline.quantize(recipe, device="cpu", progress=False)
            seconds = time.perf_counter() - start
        peak = peak_rss_bytes()
        load = os.getloadavg()  # other work on the machine stretches wall time: say how much there was
        model = runtime.load(path)
        texts = score_texts(model.logits, model.tokenizer)
    return {"tool": "lowbit", "method": method, "quantize_s": seconds, "load_average": load, "peak_rss_bytes": peak,
            "texts": texts}


def run_child(command: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    base = {t: r["texts"][t]["ppl"] for r in rows if r["method"] == "float" for t in r["texts"]}
    rtn = {t: r["texts"][t]["ppl"] for r in rows if r["method"] == "rtn" for t in r["texts"]}
    lines = ["| tool | method | Persuasion ppl | gap closed | code ppl | gap closed | quantize s | peak RSS GB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["tool"], r["method"]]
        for t in ("persuasion", "code"):
            ppl = r["texts"][t]["ppl"]
            closed = (rtn[t] - ppl) / (rtn[t] - base[t]) if t in base and t in rtn and r["method"] != "float" else None
            cells += [f"{ppl:.3f}", "–" if closed is None else f"{100 * closed:.0f}%"]
        cells += ["–" if r["quantize_s"] is None else f"{r['quantize_s']:.0f}", f"{r['peak_rss_bytes'] / 1e9:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="*", default=["float", "rtn", "gptq", "awq", "awq+gptq"])
    ap.add_argument("--peer-python", help="A Python with llm-compressor installed; adds the peers' rows.")
    ap.add_argument("--peer-methods", nargs="*", default=["gptq", "awq"])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "calibrated-cpu.json")
    ap.add_argument("--append", action="store_true", help="Add the rows to an existing --out (same protocol).")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return

    code_version = commit()  # read before the long run, so later commits cannot mislabel it
    jobs = [[sys.executable, __file__, "--one", m] for m in args.methods]
    if args.peer_python:
        jobs += [[args.peer_python, str(ROOT / "bench" / "peers.py"), m] for m in args.peer_methods]
    result = {"commit": code_version, "device": f"cpu ({os.cpu_count()} cores)", "platform": platform.platform(),
              "scheme": "4-bit, group 64, asymmetric, lm_head kept; calibration 128 x 512 tokens, seed 0",
              "load_average_at_start": os.getloadavg(), "rows": []}
    if args.append:  # rows keep their own commit: a long comparison may span more than one run
        result = json.loads(args.out.read_text())
        result.setdefault("appended", []).append({"commit": code_version, "methods": args.methods,
                                                  "load_average_at_start": os.getloadavg()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for job in jobs:
        result["rows"].append(run_child(job))
        print(json.dumps(result["rows"][-1]), flush=True)
        args.out.write_text(json.dumps(result, indent=2))  # after every row: a cut-short run keeps what it measured
    print(table(result["rows"]))


if __name__ == "__main__":
    main()
