"""lowbit's calibrated methods against RTN, the float model and llm-compressor, in one run.

    python -m bench.calibrated [--methods float rtn gptq awq awq+gptq] \
        [--peer-python /tmp/lcvenv/bin/python --peer-methods gptq awq] [--out bench/results/quality/calibrated.json]

Protocol of the GPTQ/AWQ issue: SmolLM2-135M, 4-bit (``--bits``), group 64 (``--group``),
asymmetric, lm_head kept; 128 x 512 calibration tokens from the bundled
non-evaluation Austen novels (seed 0); perplexity on the bundled Persuasion
(16,384 tokens) and, as a genre the calibration never saw, Python source (8,192
tokens), each under both protocols of `bench/scoring.py` (sliding 1,024-token
windows without BOS; disjoint windows of BOS + 511 tokens). A method may carry
settings: bare keys are the last method's (``weights.gptq`` of the recipe for
``gptq`` or ``awq+gptq``), dotted ones name their place in the recipe:
``gptq:actorder=group,dampening=0.01,dtype=float32,calibration.bos=false``,
``signround:iters=50,batch_size=4,calibration.samples=32``; a bits budget
(``gptq:weights.target_bits=3.297``) replaces ``--bits`` for its row, which then records the
budget's outcome (the manifest's ``budget``: sensitivities and each Linear's choice).
The peers read ``dampening``, ``calibration.*`` and AutoRound's ``iters`` / ``batch_size``
the same way (``--peer-methods gptq autoround:iters=50``).

Every row runs in a fresh child process, one after another, so its wall time
and peak RSS are its own; its CPU time (all threads) is recorded beside the wall time, as the
steadier figure when other work shares the machine. Wall time covers the whole job: loading the model,
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

from bench.results_file import write_result
from bench.scoring import PROTOCOLS, TEXTS, commit, parse_texts, peak_rss_bytes, protocols, score_texts

ROOT = Path(__file__).resolve().parent.parent


SYMMETRIC = False
TOP_LEVEL = ("dtype",)


def method_settings(method: str) -> tuple[str, dict]:
    """``gptq:dampening=0.01,calibration.bos=false`` -> ("gptq", {"dampening": 0.01, "calibration.bos": False})."""
    name, _, options = method.partition(":")
    return name, {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in options.split(",") if o)}


def recipe_dict(method: str, bits: int, output: str, group: int = 64) -> dict:
    name, settings = method_settings(method)
    recipe = {"model": "smollm2-135m", "output": output, "dtype": "bfloat16",
              "weights": {"method": name, "bits": bits, "group_size": group, "symmetric": SYMMETRIC}}
    for key, value in settings.items():
        if key in TOP_LEVEL:
            recipe[key] = value
        elif "." in key:
            section, field = key.split(".", 1)
            recipe.setdefault(section, {})[field] = value
        else:  # the last method's: the rounding method of "awq+gptq", AWQ's own for "awq"
            recipe["weights"].setdefault(name.split("+")[-1], {})[key] = value
    if "target_bits" in recipe["weights"]:  # a bits budget replaces the row's one width
        del recipe["weights"]["bits"]
    return recipe


def one(method: str, bits: int, group: int, texts: dict[str, int]) -> dict:
    """Quantize with lowbit (or load the float model for ``float``) and score it."""
    import runtime
    from evals.size import weight_stats
    from lowbit import pipeline
    from lowbit.recipe_parse import parse_recipe
    from quant.models import resolve

    budget = cpu_seconds = None
    with tempfile.TemporaryDirectory() as tmp:
        start, cpu_start = time.perf_counter(), time.process_time()
        if method == "float":
            path, seconds = resolve("smollm2-135m"), None
        else:
            recipe = parse_recipe(recipe_dict(method, bits, f"{tmp}/ckpt", group))
            path = pipeline.quantize(recipe, device="cpu", progress=False)
            seconds = time.perf_counter() - start
            cpu_seconds = time.process_time() - cpu_start
            budget = json.loads((path / "lowbit_manifest.json").read_text()).get("budget")
        peak = peak_rss_bytes()
        load = os.getloadavg()  # other work on the machine stretches wall time: say how much there was
        model = runtime.load(path)
        scores = score_texts(model.logits, model.tokenizer, texts)
        bits_per_weight = weight_stats(path).bits_per_weight
    return {"tool": "lowbit", "method": method, "bits": bits, "group_size": group, "quantize_s": seconds,
            "quantize_cpu_s": cpu_seconds, "load_average": load,
            "peak_rss_bytes": peak, "bits_per_weight": bits_per_weight,
            "budget": budget,
            "scores": scores}


def score_saved(path: str, texts: dict[str, int]) -> dict:
    """A saved checkpoint through lowbit's runtime (the peer side loads it with transformers)."""
    import runtime

    model = runtime.load(path)
    return {"tool": "lowbit runtime", "method": f"loaded {Path(path).name}", "checkpoint": path,
            "scores": score_texts(model.logits, model.tokenizer, texts)}


def loader_jobs(paths: list[str], peer_python: str | None, shared: list[str]) -> list[list[str]]:
    """Each checkpoint scored by lowbit's runtime and, with a peer Python, by transformers in its dtype and float32."""
    jobs = []
    for path in paths:
        jobs.append([sys.executable, "-m", "bench.calibrated", "--score-one", path, *shared])
        if peer_python:
            jobs += [[peer_python, "-m", "bench.peers", "--score-checkpoint", path, "--dtype", d, *shared]
                     for d in ("auto", "float32")]
    return jobs


def run_child(command: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict], protocol: str) -> str:
    """Markdown table of one protocol's perplexities, with the share of RTN's gap each method closes."""
    def ppl(r, t):
        return r["scores"][protocol][t]["ppl"]

    base = {t: ppl(r, t) for r in rows if r["method"] == "float" for t in r["scores"][protocol]}
    rtn = {t: ppl(r, t) for r in rows if r["method"] == "rtn" for t in r["scores"][protocol]}
    lines = ["| tool | method | Persuasion ppl | gap closed | code ppl | gap closed | quantize s | peak RSS GB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["tool"], r["method"]]
        for t in ("persuasion", "code"):
            known = t in base and t in rtn and r["method"] != "float"
            closed = (rtn[t] - ppl(r, t)) / (rtn[t] - base[t]) if known else None
            cells += [f"{ppl(r, t):.3f}", "–" if closed is None else f"{100 * closed:.0f}%"]
        cells += ["–" if r["quantize_s"] is None else f"{r['quantize_s']:.0f}", f"{r['peak_rss_bytes'] / 1e9:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="*", default=["float", "rtn", "gptq", "awq", "awq+gptq"])
    ap.add_argument("--peer-python", help="A Python with llm-compressor installed; adds the peers' rows.")
    ap.add_argument("--peer-methods", nargs="*", help="Default: gptq awq, none with --loaded.")
    ap.add_argument("--bits", type=int, default=4, help="Weight bits of every row, lowbit's and the peers'.")
    ap.add_argument("--group", type=int, default=64, help="Group size of every row, lowbit's and the peers'.")
    ap.add_argument("--texts", nargs="*", default=[f"{t}={n}" for t, n in TEXTS.items()],
                    help="Texts and tokens scored (fewer on a busy machine): persuasion=16384 code=8192")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "quality" / "calibrated.json")
    ap.add_argument("--append", action="store_true", help="Add the rows to an existing --out (same protocol).")
    ap.add_argument("--loaded", nargs="*", default=[], metavar="DIR",
                    help="Saved checkpoints to score through lowbit's runtime and (with --peer-python) transformers.")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--score-one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one or args.score_one:
        texts = parse_texts(args.texts)
        row = one(args.one, args.bits, args.group, texts) if args.one else score_saved(args.score_one, texts)
        print(json.dumps(row))
        return

    code_version = commit()  # read before the long run, so later commits cannot mislabel it
    shared = ["--bits", str(args.bits), "--group", str(args.group), "--texts", *args.texts]
    jobs = [[sys.executable, "-m", "bench.calibrated", "--one", m, *shared] for m in args.methods]
    peer_methods = args.peer_methods if args.peer_methods is not None else [] if args.loaded else ["gptq", "awq"]
    if args.peer_python:
        jobs += [[args.peer_python, "-m", "bench.peers", m, *shared] for m in peer_methods]
    jobs += loader_jobs(args.loaded, args.peer_python, ["--texts", *args.texts])
    from evals.provenance import versions

    result = {"commit": code_version, "device": f"cpu ({os.cpu_count()} cores)", "platform": platform.platform(),
              "versions": versions(),
              "scheme": f"{args.bits}-bit, group {args.group}, asymmetric, lm_head kept; "
                        "calibration 128 x 512 tokens, seed 0",
              "protocols": {name: {t: p.describe() for t, p in protocols(name, parse_texts(args.texts)).items()}
                            for name in PROTOCOLS},
              "load_average_at_start": os.getloadavg(), "rows": []}
    if args.append:  # rows keep their own commit: a long comparison may span more than one run
        result = json.loads(args.out.read_text())
        result.setdefault("appended", []).append({"commit": code_version, "methods": args.methods,
                                                  "load_average_at_start": os.getloadavg()})
    for job in jobs:
        result["rows"].append(run_child(job))
        print(json.dumps(result["rows"][-1]), flush=True)
        write_result(args.out, result)  # after every row: a cut-short run keeps what it measured
    for name in PROTOCOLS:
        print(f"\n{name}:\n{table([r for r in result['rows'] if 'quantize_s' in r], name)}")


if __name__ == "__main__":
    main()
