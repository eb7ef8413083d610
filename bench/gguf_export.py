"""lowbit's checkpoints exported to GGUF and run by llama.cpp's own perplexity tool, beside lowbit's
runtime on the same token ids and the same protocol (issue 33, item 3).

    make llama-cpp                                   # once: llama.cpp's tools in .llama-cpp/
    .venv/bin/python -m bench.gguf_export [--chunks 8] [--ctx 512]
        # results: bench/results/gguf/export-smollm2.json

For SmolLM2-135M and RTN checkpoints on GGUF's own grids (W4 g32 symmetric -> Q4_0, W4 g32 with zero
points -> Q4_1, W8 g32 symmetric -> Q8_0, codes copied by ``lowbit export --gguf exact``), and the
float model (F16): ``llama-perplexity -c CTX --chunks N`` on the first tokens of the bundled
evaluation text (Persuasion), and lowbit's runtime (float32, the dense reference path: the exact grid)
on the token ids llama.cpp's tokenizer gives, scored as llama-perplexity scores them (each chunk
begins with BOS when the vocabulary adds one; the second half of each chunk is scored). Each
checkpoint is also exported as F32 (the same weights, float matmuls in llama.cpp): what separates
the quantized file from lowbit is then llama.cpp's 8-bit quantization of the activations in its
quantized dot products, not the file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import tempfile
from pathlib import Path

import torch

from bench.results_file import write_result
from bench.gguf_vs_llamacpp import LLAMA_BIN, SDIST, eval_texts, run_tool

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "gguf" / "export-smollm2.json"
CHECKPOINTS = {  # name: (weights of the recipe, GGUF type its grid is); None: the float model
    "float": (None, "F16"),
    "rtn-w4g32-sym": ({"method": "rtn", "bits": 4, "group_size": 32, "symmetric": True}, "Q4_0"),
    "rtn-w4g32-asym": ({"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False}, "Q4_1"),
    "rtn-w8g32-sym": ({"method": "rtn", "bits": 8, "group_size": 32, "symmetric": True}, "Q8_0"),
}


def llama_cpp_module():
    os.environ["LLAMA_CPP_LIB_PATH"] = str(LLAMA_BIN)
    sys.path[:0] = [str(SDIST), str(SDIST.parent / "python")]
    import llama_cpp

    return llama_cpp


def llama_tokens(gguf: Path, text: str) -> tuple[list[int], bool, int]:
    """The token ids llama-perplexity evaluates (its tokenizer, BOS as the vocabulary says), whether
    the vocabulary adds BOS, and the BOS id."""
    llama_cpp = llama_cpp_module()
    model = llama_cpp.Llama(str(gguf), vocab_only=True, verbose=False)
    try:
        vocab = llama_cpp.llama_model_get_vocab(model.model)
        add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        return model.tokenize(text.encode(), add_bos=True, special=False), add_bos, model.token_bos()
    finally:
        model.close()


def llama_perplexity(gguf: Path, text: Path, ctx: int, chunks: int, threads: int, log: Path) -> float:
    out = run_tool(LLAMA_BIN, "llama-perplexity", "-m", gguf, "-f", text, "-c", ctx, "-b", ctx, "-t", threads,
                   "--chunks", chunks, log=log)
    found = re.search(r"Final estimate: PPL = ([\d.]+)", out)
    if found is None:
        raise RuntimeError(f"no perplexity in {log}")
    return float(found.group(1))


def lowbit_perplexity(ckpt: Path, tokens: list[int], add_bos: bool, bos: int, ctx: int, chunks: int) -> float:
    """lowbit's runtime scored as llama-perplexity scores (tools/perplexity/perplexity.cpp, perplexity())."""
    import runtime

    model = runtime.load(ckpt, dtype=torch.float32, cpu_kernels=False)
    first, nll, count = ctx // 2, 0.0, 0
    for i in range(chunks):
        ids = torch.tensor(tokens[i * ctx:(i + 1) * ctx])
        targets = ids[first + 1:].clone()
        if add_bos:
            ids[0] = bos
        logits = model.logits(ids[None])[0, first:ctx - 1].double()
        nll -= logits.log_softmax(-1).gather(-1, targets[:, None]).sum().item()
        count += len(targets)
    return math.exp(nll / count)


def make_checkpoint(name: str, weights: dict | None, work: Path) -> Path:
    from lowbit import pipeline
    from lowbit.recipe_parse import parse_recipe
    from quant import models

    if weights is None:
        return models.resolve("smollm2-135m")
    recipe = parse_recipe({"model": "smollm2-135m", "output": str(work / name), "dtype": "bfloat16",
                           "weights": weights})
    return pipeline.quantize(recipe, progress=False)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if not (LLAMA_BIN / "llama-perplexity").exists():
        sys.exit(f"no llama-perplexity in {LLAMA_BIN}: `make llama-cpp` builds it")
    from transformers import AutoTokenizer

    from evals.provenance import commit, cpu_name, versions
    from quant import models
    from quant.gguf.export import export

    work = Path(tempfile.mkdtemp(prefix="gguf-export-"))
    text = eval_texts(AutoTokenizer.from_pretrained(models.resolve("smollm2-135m")),
                      (args.chunks + 1) * args.ctx, work)["persuasion"]
    rows = {}
    for name, (weights, exact_type) in CHECKPOINTS.items():
        ckpt = make_checkpoint(name, weights, work)
        files = {t: work / f"{name}-{t}.gguf" for t in dict.fromkeys((exact_type, "F32"))}
        reports = {t: export(str(ckpt), t if weights is None else ("exact" if t != "F32" else t), path)
                   for t, path in files.items()}
        tokens, add_bos, bos = llama_tokens(files[exact_type], text.read_text())
        row = {"lowbit": lowbit_perplexity(ckpt, tokens, add_bos, bos, args.ctx, args.chunks)}
        for t, path in files.items():
            row[f"llama.cpp {t}"] = llama_perplexity(path, text, args.ctx, args.chunks, args.threads,
                                                     work / f"{name}-{t}.log")
            row[f"llama.cpp {t} vs lowbit %"] = 100 * (row[f"llama.cpp {t}"] / row["lowbit"] - 1)
            row[f"{t} bytes"] = path.stat().st_size
        row["export"] = reports[exact_type].lines()
        rows[name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "export"}), flush=True)
    result = {
        "what": "SmolLM2-135M checkpoints exported to GGUF (lowbit export --gguf exact / F16 / F32): llama.cpp's "
                "llama-perplexity beside lowbit's runtime (float32 dense reference) on the same token ids, scored "
                "as llama-perplexity scores",
        "protocol": f"llama-perplexity -c {args.ctx} -b {args.ctx} --chunks {args.chunks} -t {args.threads} on the "
                    f"first {(args.chunks + 1) * args.ctx} tokens of the bundled Persuasion text; lowbit: the same "
                    "ids from llama.cpp's tokenizer, BOS as its vocabulary adds it, second half of each chunk scored",
        "rows": rows,
        "device": platform.processor() or platform.machine(),
        "cpu": cpu_name(),
        "machine_note": "shared 2-core machine (quality numbers; nothing here is timed)",
        "versions": {**versions(), "llama.cpp": llama_cpp_version(work), "llama-cpp-python sdist": SDIST.name},
        "commit": commit(),
        "command": "python -m bench.gguf_export " + " ".join(sys.argv[1:]),
    }
    write_result(args.out, result)


def llama_cpp_version(work: Path) -> str:
    """What ``llama-perplexity --version`` says (``0.5.0-dev (build 1, commit 0c1e570)``)."""
    out = run_tool(LLAMA_BIN, "llama-perplexity", "--version", log=work / "version.log")
    found = re.search(r"version: (.+)", out)
    return found.group(1).strip() if found else out.strip().splitlines()[-1]


if __name__ == "__main__":
    main()
