"""lowbit's GGUF files against llama.cpp's own quantization with an importance matrix, judged by
llama.cpp's own perplexity tool, in one run.

    python -m bench.gguf_vs_llamacpp [--mixes Q2_K Q3_K_M Q4_K_M] [--samples 128] [--seq-len 512]
        [--calibration mixed] [--eval-tokens 8192] [--out bench/results/gguf/gguf-vs-llamacpp-mixed.json]

On SmolLM2-135M (lowbit's bundled model, its float weights as lowbit resolves them):

1. the float model as an F32 GGUF (lowbit's writer), the source of every file;
2. lowbit's calibration windows (``--calibration``, default ``mixed``: Austen prose, CPython
   source, the Python reference, ``quant.calibration``; 128 x 512 tokens, seed 0), decoded and
   joined into one text file; ``llama-imatrix`` on it (``-c`` the window length, one chunk per
   window);
3. per mix: ``llama-quantize --imatrix`` and ``llama-quantize`` without one, and lowbit's file
   (``quant.gguf_quantize``: the same per-tensor types, checked tensor by tensor against
   llama.cpp's imatrix file; GPTQ on each type's fitted grid, from the same windows);
4. ``llama-perplexity`` on the first ``--eval-tokens`` tokens of each evaluation text, none of
   them calibrated on: Persuasion (prose), CPython's argparse.py (code), package READMEs
   (Markdown docs, ``evals.texts``), ``-c`` 512: the float file's run saves its logits
   (``--kl-divergence-base``), every quantized file is scored against them (``--kl-divergence``):
   its perplexity, ln(PPL/PPL(float)) and the mean KL divergence from the float model, each with
   llama.cpp's error estimate (the last two are paired per token, so much tighter than the
   perplexity's own). Bits per weight from the file's tensors.

Needs llama.cpp's tools built by ``make llama-cpp`` (``.llama-cpp/build/bin``; ``--llama-bin``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import re
import subprocess
import tempfile
import time
import threading
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

from bench.results_file import write_result

ROOT = Path(__file__).resolve().parent.parent
LLAMA_BIN = ROOT / ".llama-cpp" / "build" / "bin"
SDIST = ROOT / ".llama-cpp" / "llama_cpp_python-0.3.36"
TEXTS = ("persuasion", "code", "docs")


def run_tool(bin_dir: Path, tool: str, *args, log: Path) -> str:
    """Run one llama.cpp tool; its whole output is kept in ``log`` and returned."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(bin_dir)}
    proc = subprocess.run([str(bin_dir / tool), *map(str, args)], capture_output=True, text=True, env=env)
    out = proc.stdout + proc.stderr
    log.write_text(out)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} failed ({proc.returncode}); its output: {log}\n{out[-2000:]}")
    return out


def perplexity(bin_dir: Path, model: Path, text: Path, ctx: int, threads: int, log: Path, base: Path) -> dict:
    """The float file's perplexity (its logits saved to ``base``), or a quantized file's scored
    against ``base`` when that exists: perplexity, ln(PPL/PPL(base)) and mean KL divergence."""
    # --no-repack: no AMX/repacked weight buffers (on a VM whose CPU reports AMX tiles that fault,
    # llama-perplexity dies of SIGILL on any quantized file); llama.cpp's plain CPU kernels instead
    common = ("-m", model, "-c", ctx, "-b", ctx, "-t", threads, "--no-repack", "--kl-divergence-base", base)
    if not base.exists():
        out = run_tool(bin_dir, "llama-perplexity", *common, "-f", text, log=log)
        ppl = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", out)
        if ppl is None:
            raise RuntimeError(f"no perplexity in {log}")
        return {"ppl": float(ppl.group(1)), "ppl_err": float(ppl.group(2)), **file_facts(model)}
    out = run_tool(bin_dir, "llama-perplexity", *common, "--kl-divergence", log=log)
    found = {}
    for key, label in (("ppl", r"Mean PPL\(Q\)"), ("ln_ppl_ratio", r"Mean ln\(PPL\(Q\)/PPL\(base\)\)"),
                       ("kld", r"Mean\s+KLD"), ("same_top_token_pct", r"Same top p")):
        m = re.search(label + r"\s*:\s*([-\d.]+)\s*±\s*([\d.]+)", out)
        if m is None:
            raise RuntimeError(f"no {key} (llama.cpp: {label}) in {log}")
        found[key], found[f"{key}_err"] = float(m.group(1)), float(m.group(2))
    return {**found, **file_facts(model)}


def file_facts(model: Path) -> dict:
    return {"bpw": bits_per_weight(model), "file_bytes": model.stat().st_size}


def tensor_types(model: Path) -> dict[str, str]:
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(model).tensors}


def bits_per_weight(model: Path) -> float:
    """Bits per weight of the file's tensors, as llama.cpp counts them (every tensor's stored bytes over
    its elements; this build's llama-perplexity does not print it)."""
    import gguf

    tensors = gguf.GGUFReader(model).tensors
    return round(8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors), 3)


def llama_version(bin_dir: Path, work: Path) -> str:
    try:
        out = run_tool(bin_dir, "llama-perplexity", "--version", log=work / "version.log")
    except RuntimeError as e:
        out = str(e)
    found = re.search(r"version: (\S+) \(build (\d+), commit (\w+)\)", out)
    return f"{found.group(1)} (commit {found.group(3)})" if found else out.strip().splitlines()[-1]


def eval_texts(tokenizer, tokens: int, work: Path) -> dict[str, Path]:
    """The first ``tokens`` tokens of each evaluation text, decoded back to a file for llama.cpp."""
    from evals.texts import load_text

    paths = {}
    for name in TEXTS:
        ids = tokenizer(load_text(name), add_special_tokens=False).input_ids[:tokens]
        paths[name] = work / f"eval-{name}.txt"
        paths[name].write_text(tokenizer.decode(ids))
    return paths


def lowbit_file(source: Path, mix: str, samples, out: Path, made_with: dict, threads: int) -> dict:
    """lowbit's file for ``mix`` at ``out``, and beside it (``.json``) how it was made and its facts:
    a later run with the same ``made_with`` (settings, windows, commit) takes the file as it is."""
    import torch

    from quant import models
    from quant.gptq import GPTQConfig

    torch.set_num_threads(threads)
    from quant.gguf_quantize import quantize_gguf, write

    model, _, lazy = models.load_lazily(source)
    start = time.process_time()
    settings = {"gptq": GPTQConfig(**made_with["gptq"])}
    fields, _ = quantize_gguf(model, mix, made_with["methods"], samples=samples, settings=settings, lazy=lazy,
                              progress=False)
    seconds = time.process_time() - start
    types = write(out, source, fields, overwrite=True)
    counts = {}
    for t in types.values():
        counts[t] = counts.get(t, 0) + 1
    facts = {"quantize_cpu_s": round(seconds, 1), "tensor_types": counts}
    out.with_suffix(".json").write_text(json.dumps({"made_with": made_with, "facts": facts}, indent=2))
    return facts


def quant_source_digest() -> str:
    """A digest of the sources on lowbit's GPTQ-to-GGUF path: what a kept file must have been made by
    (the tree's commit moves with every unrelated commit in a shared checkout)."""
    import hashlib

    quant = ROOT / "quant"
    files = [quant / f for f in ("gguf_fit.py", "gptq.py", "quantize.py", "sequential.py", "gram.py", "calibration.py",
                                 "methods/gptq.py")] + sorted((quant / "gguf").glob("*.py"))
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]


def extra_rows(folders: list[Path], mixes: list[str], made_with: dict) -> list[tuple]:
    """(label, path, facts) of lowbit's files in ``folders`` made from the same windows and sources as
    this run's but other GPTQ settings (a file made otherwise is refused)."""
    rows = []
    for folder in folders:
        for mix in mixes:
            path = folder / f"lowbit-{mix}.gguf"
            while not path.with_suffix(".json").exists():  # its --lowbit-only run is still at work
                time.sleep(30)
            kept = json.loads(path.with_suffix(".json").read_text())
            other = kept["made_with"]
            if {k: v for k, v in other.items() if k != "gptq"} != {k: v for k, v in made_with.items() if k != "gptq"}:
                raise SystemExit(f"{path} was made from other windows or sources: {other}")
            settings = ",".join(f"{k}={v}" for k, v in other["gptq"].items())
            rows.append((f"lowbit {'+'.join(other['methods'])} ({settings}) {mix}", path,
                         {"mix": mix, **kept["facts"], "made_by_earlier_run": True, "gptq": other["gptq"]}))
    return rows


def made_before(out: Path, made_with: dict) -> dict | None:
    """The facts of a lowbit file an earlier run (``--lowbit-only``) made the same way, else None."""
    stamp = out.with_suffix(".json")
    if not (out.exists() and stamp.exists()):
        return None
    kept = json.loads(stamp.read_text())
    return {**kept["facts"], "made_by_earlier_run": True} if kept["made_with"] == made_with else None


def same_types(ours: Path, theirs: Path) -> dict:
    """Tensor by tensor, whether two files store the same GGUF types (the mix's choices)."""
    a, b = tensor_types(ours), tensor_types(theirs)
    differ = sorted(n for n in a.keys() | b.keys() if a.get(n) != b.get(n))
    return {"tensors": len(a.keys() | b.keys()), "equal": len(a.keys() | b.keys()) - len(differ),
            "differ": {n: [a.get(n), b.get(n)] for n in differ}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixes", nargs="+", default=["Q2_K", "Q3_K_M", "Q4_K_M"])
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--calibration", default="mixed", help="quant.calibration's source for both tools")
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=["gptq"])
    ap.add_argument("--dampening", type=float, default=None, help="GPTQ's (default: quant.gptq.GPTQConfig's)")
    ap.add_argument("--actorder", default=None, help="GPTQ's column order (default: GPTQConfig's)")
    ap.add_argument("--lowbit-only", action="store_true",
                    help="only make lowbit's files in --work; a full run with the same settings at the same commit "
                         "takes them as they are (said in each row)")
    ap.add_argument("--wait-lowbit", action="store_true",
                    help="lowbit's files missing from --work are being made by a --lowbit-only run: wait for them")
    ap.add_argument("--jobs", type=int, default=3, help="lowbit files made at once (--threads each)")
    ap.add_argument("--extra-lowbit", type=Path, nargs="*", default=[],
                    help="--work folders of --lowbit-only runs with other GPTQ settings (same windows and sources): "
                         "their files scored as more rows, labelled with their settings")
    ap.add_argument("--score-jobs", type=int, default=1, help="llama-perplexity runs at once (--threads each)")
    ap.add_argument("--no-plain", action="store_true", help="skip llama-quantize without an imatrix")
    ap.add_argument("--llama-bin", type=Path, default=LLAMA_BIN)
    ap.add_argument("--work", type=Path, default=None, help="keep the files here (default: a temporary directory)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gguf" / "gguf-vs-llamacpp-mixed.json")
    args = ap.parse_args()

    import torch
    import transformers

    from evals.provenance import commit, versions
    from quant import models
    from quant.calibration import calibration_samples, load_calibration_text
    from quant.gguf_quantize import write

    code_version = commit()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    tmp = None if args.work else tempfile.TemporaryDirectory(prefix="gguf-bench-")
    work = args.work or Path(tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    source = models.resolve("smollm2-135m")
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    samples = calibration_samples(tokenizer, load_calibration_text(args.calibration), args.samples, args.seq_len, 0, None)
    calib = work / "calibration.txt"
    calib.write_text("".join(tokenizer.decode(s) for s in samples))
    texts = eval_texts(tokenizer, args.eval_tokens, work)
    f32 = work / "f32.gguf"
    write(f32, source, {}, overwrite=True)
    imatrix = work / "imatrix.gguf"
    gptq = {k: v for k, v in (("dampening", args.dampening), ("actorder", args.actorder)) if v is not None}
    made_with = {"methods": args.methods, "gptq": gptq, "calibration": args.calibration, "samples": args.samples,
                 "seq_len": args.seq_len, "seed": 0, "quant_source": quant_source_digest()}
    # lowbit's files are made in worker processes while llama.cpp's tools run
    pool = ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=multiprocessing.get_context("spawn"))
    made = {}
    for mix in args.mixes:
        out = work / f"lowbit-{mix}.gguf"
        kept = None if args.lowbit_only else made_before(out, made_with)
        if kept or args.wait_lowbit:
            made[mix] = kept
        else:
            made[mix] = pool.submit(lowbit_file, source, mix, samples, out, made_with, args.threads)
    if args.lowbit_only:
        for mix, future in made.items():
            print(mix, future.result(), flush=True)
        return
    files = {"float (F32)": (f32, {})}
    start = time.perf_counter()
    run_tool(args.llama_bin, "llama-imatrix", "-m", f32, "-f", calib, "-o", imatrix, "-c", args.seq_len,
             "-b", args.seq_len, "--chunks", args.samples, "-t", args.threads, log=work / "imatrix.log")
    imatrix_s = time.perf_counter() - start
    for mix in args.mixes:
        variants = [("llama.cpp imatrix", ["--imatrix", imatrix])] + ([] if args.no_plain else [("llama.cpp", [])])
        for label, extra in variants:
            out = work / f"llama-{'imat-' if extra else ''}{mix}.gguf"
            start = time.perf_counter()
            run_tool(args.llama_bin, "llama-quantize", *extra, f32, out, mix, args.threads,
                     log=work / f"{out.stem}.log")
            files[f"{label} {mix}"] = (out, {"mix": mix, "quantize_s": round(time.perf_counter() - start, 1)})
    result = {
        "bench": "gguf_vs_llamacpp",
        "command": "python -m bench.gguf_vs_llamacpp " + " ".join(os.sys.argv[1:]),
        "commit": code_version,
        "machine": {"cpu": platform.processor() or platform.machine(), "note": "shared 2-core machine",
                    "load_average_at_start": load_at_start},
        "versions": {**versions(), "llama.cpp": llama_version(args.llama_bin, work),
                     "llama.cpp source": "vendor/llama.cpp of the llama-cpp-python 0.3.36 sdist"},
        "protocol": {
            "model": "smollm2-135m (lowbit's bundled default, float weights as lowbit resolves them), F32 GGUF source",
            "calibration": f"{args.samples} x {args.seq_len} tokens of quant.calibration's {args.calibration!r} "
                           f"source (seed 0; 'mixed': Austen prose, CPython Lib/ source without argparse.py, the "
                           f"Python reference's topics), decoded and joined for llama-imatrix (-c {args.seq_len}, "
                           f"{args.samples} chunks); lowbit {'+'.join(args.methods)} on the same token windows",
            "evaluation": f"llama-perplexity -c {args.ctx} on the first {args.eval_tokens} tokens of each text "
                          f"({', '.join(TEXTS)}: Persuasion, CPython argparse.py, package READMEs in Markdown; none "
                          f"calibrated on), decoded to text; the float file's logits saved (--kl-divergence-base), "
                          f"every quantized file scored against them (--kl-divergence): PPL, ln(PPL/PPL(float)) "
                          f"and mean KLD with llama.cpp's +/- (one standard error)",
            "lowbit": made_with,
            "imatrix_s": round(imatrix_s, 1), "torch_threads": torch.get_num_threads(),
        },
        "rows": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in texts:  # a kept --work directory's float logits are from an earlier run
        (work / f"float-logits-{name}.kld").unlink(missing_ok=True)

    written = threading.Lock()

    def score(label: str, path: Path, facts: dict) -> None:
        row = {"file": label, **facts}
        for name, text in texts.items():
            row[name] = perplexity(args.llama_bin, path, text, args.ctx, args.threads, work / f"{path.stem}-{name}.log",
                                   work / f"float-logits-{name}.kld")
        with written:
            result["rows"].append(row)
            write_result(args.out, result)  # after every row: a cut-short run keeps what it measured
            print(label, {n: row[n]["ppl"] for n in texts}, "bpw", row[TEXTS[0]]["bpw"], flush=True)

    def score_lowbit(mix: str, future) -> None:
        path = work / f"lowbit-{mix}.gguf"
        while future is None and (future := made_before(path, made_with)) is None:
            time.sleep(30)
        made_facts = future if isinstance(future, dict) else future.result()
        score(f"lowbit {'+'.join(args.methods)} {mix}", path,
              {"mix": mix, **made_facts, "types_vs_llama_imatrix": same_types(path, files[f"llama.cpp imatrix {mix}"][0])})

    (label, (path, facts)), *others = files.items()
    score(label, path, facts)  # the float file first: it saves the logits the others are scored against
    # llama.cpp's files while lowbit's are still being made; --score-jobs llama-perplexity runs at once
    with ThreadPoolExecutor(max_workers=max(1, args.score_jobs)) as scorers:
        done = [scorers.submit(score, label, path, facts) for label, (path, facts) in others]
        done += [scorers.submit(score_lowbit, mix, future) for mix, future in made.items()]
        for row in extra_rows(args.extra_lowbit, args.mixes, made_with):
            done.append(scorers.submit(score, *row))
        for d in done:
            d.result()
    pool.shutdown()
    result["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_result(args.out, result)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
