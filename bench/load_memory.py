"""Memory of ``runtime.load`` on CPU: a W4 checkpoint against its float model, and a
Llama-3-8B-shaped W4 checkpoint loaded and decoded on a 24 GB machine.

    python -m bench.load_memory [--shapes smollm2-135m,llama-1b] [--llama-8b]

Checkpoints with random weights at real shapes (``bench/cpu_decode.SHAPES``; Meta-Llama-3-8B's
config for ``--llama-8b``) are written to a temporary directory one decoder layer per safetensors
file, so writing never holds a whole model: the float model in bf16 (as Hub checkpoints store it),
W4 group 64 asymmetric for every decoder Linear (lm_head and embeddings bf16). Each is loaded in a
fresh child process by ``runtime.load`` (CPU, its default dtype float32; the W4 Linears through the
CPU kernels, the W4 model's embedding and lm_head kept in bf16, ``runtime.load.narrow_float_weights``) while a sampler thread reads resident memory every 5 ms. Reported per checkpoint:
``rss_before`` (torch and lowbit imported), ``peak`` during the load, ``rss_after``, the load's own
``peak - rss_before`` and, for the 8B, the peak while decoding a few tokens. Ratios W4/float of the
load's own peak and of the absolute peak. Raw JSON with device, versions and commit under
bench/results/cpu/; the temporary checkpoints are deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # the CLI's OpenMP default, before torch loads (its children inherit it): spinning
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # threads on a busy machine made the decode rows 10x slower

import torch  # noqa: E402

from bench.cpu_decode import SCHEME, SHAPES  # noqa: E402
from bench.memory import PeakSampler, rss  # noqa: E402
from bench.results_file import write_result  # noqa: E402
from evals.provenance import commit, cpu_name, versions  # noqa: E402
from evals.serving import LLAMA3_8B  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


LLAMA_8B = {**LLAMA3_8B, "head_dim": 128}


def write_checkpoint(path: Path, config: dict, quantized: bool, seed: int = 0) -> int:
    """A checkpoint with random weights, one decoder layer per file; returns its bytes on disk."""
    from safetensors.torch import save_file

    from quant.affine import QuantScheme
    from quant.format import quantization_config
    from runtime.load import linear_factory, linear_names
    from runtime.model import Decoder, DecoderConfig

    cfg = DecoderConfig.from_hf(config)
    names = [n for n in linear_names(cfg) if n != "lm_head"] if quantized else []
    scheme = QuantScheme(**SCHEME)
    with torch.device("meta"):
        shapes = Decoder(cfg, linear_factory({n: scheme for n in names})).state_dict()
    if cfg.tie_embeddings:
        shapes.pop("lm_head.weight", None)
    g = torch.Generator().manual_seed(seed)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name in shapes:  # group names by file: model.layers.<i>. or the rest
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else "rest"
        parts.setdefault(key, {})[name] = shapes[name]
    path.mkdir(parents=True)
    for i, (key, tensors) in enumerate(parts.items()):
        out = {}
        for name, t in tensors.items():
            if t.dtype == torch.int32:
                out[name] = torch.randint(-2**31, 2**31 - 1, t.shape, dtype=torch.int32, generator=g)
            elif name.endswith("weight_shape"):
                out[name] = torch.tensor(t.shape, dtype=torch.int64)
            elif name.endswith("weight_scale"):
                out[name] = (torch.rand(t.shape, generator=g) * 0.004 + 0.001).bfloat16()
            elif "norm" in name:
                out[name] = torch.ones(t.shape, dtype=torch.bfloat16)
            else:
                out[name] = (torch.randn(t.shape, generator=g) * 0.02).bfloat16()
        for name in [n for n in out if n.endswith("weight_packed")]:  # the Linear's [out, in]
            prefix = name[: -len("weight_packed")]
            rows, words = out[name].shape
            out[prefix + "weight_shape"] = torch.tensor([rows, words * 32 // scheme.bits])
        save_file(out, path / f"model-{i:05d}.safetensors", metadata={"format": "pt"})
        del out
    full = {**config, "architectures": ["LlamaForCausalLM"], "dtype": "bfloat16"}
    if quantized:
        full["quantization_config"] = quantization_config({n: scheme for n in names}, ["lm_head"])
    (path / "config.json").write_text(json.dumps(full, indent=2))
    return sum(f.stat().st_size for f in path.iterdir())


def one(path: Path, decode_tokens: int) -> dict:
    """In this process: load ``path`` and report resident memory (the child's side)."""
    import warnings

    import runtime

    warnings.simplefilter("ignore")  # no manifest: the unverified-checkpoint warning
    before = rss()
    start = time.perf_counter()
    with PeakSampler() as sampler:
        model = runtime.load(path, self_check=False)
    row = {"rss_before": before, "peak": sampler.peak, "rss_after": rss(), "load_s": time.perf_counter() - start}
    if decode_tokens:
        from evals.speed import run_request

        prompt = torch.randint(0, model.decoder.cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
        with PeakSampler() as sampler:
            ttft, itls, tokens = run_request(model, prompt, decode_tokens)
        row.update(decode_peak=sampler.peak, decoded=tokens.shape[1], ttft_s=ttft,
                   median_itl_s=sorted(itls)[len(itls) // 2] if itls else None)
    return row


def measure(path: Path, decode_tokens: int = 0) -> dict:
    command = [sys.executable, "-m", "bench.load_memory", "--one", str(path), "--decode", str(decode_tokens)]
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-135m,llama-1b")
    ap.add_argument("--llama-8b", action="store_true", help="also write, load and decode a Llama-3-8B-shaped W4 checkpoint")
    ap.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu" / "load-memory.json")
    ap.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--decode", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.decode)))
        return
    result = {"commit": commit(), "device": f"cpu: {cpu_name()}", "threads": torch.get_num_threads(),
              "versions": versions(), "protocol": __doc__.split("\n\n", 2)[2].strip(),
              "note": "a shared machine: other sessions' processes ran at the same time (their memory is not counted: RSS is per process)",
              "rows": []}
    for shape in [s for s in args.shapes.split(",") if s]:
        row = {"shape": shape}
        for kind in ("float", "w4"):
            tmp = Path(tempfile.mkdtemp(prefix=f"lowbit-{shape}-{kind}-", dir=args.tmp))
            try:
                disk = write_checkpoint(tmp / "ckpt", SHAPES[shape], quantized=kind == "w4")
                row[kind] = {"disk_bytes": disk, **measure(tmp / "ckpt", decode_tokens=4)}
            finally:
                shutil.rmtree(tmp)
            row[kind]["load_own"] = row[kind]["peak"] - row[kind]["rss_before"]
        row["w4_over_float_own"] = row["w4"]["load_own"] / row["float"]["load_own"]
        row["w4_over_float_peak"] = row["w4"]["peak"] / row["float"]["peak"]
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.llama_8b:
        tmp = Path(tempfile.mkdtemp(prefix="lowbit-llama-8b-w4-", dir=args.tmp))
        try:
            start = time.perf_counter()
            disk = write_checkpoint(tmp / "ckpt", LLAMA_8B, quantized=True)
            row = {"shape": "llama-3-8b", "w4": {"disk_bytes": disk, "write_s": time.perf_counter() - start,
                                                 **measure(tmp / "ckpt", decode_tokens=4)},
                   # the float model is not loaded: Meta-Llama-3-8B's parameters take 32.1 GB in float32 (the CPU
                   # default dtype), more than this 24 GB machine; 16.1 GB in bf16, not tried beside other jobs
                   "float32_weight_bytes": 4 * 8_030_261_248, "bf16_weight_bytes": 2 * 8_030_261_248}
        finally:
            shutil.rmtree(tmp)
        row["w4"]["load_own"] = row["w4"]["peak"] - row["w4"]["rss_before"]
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
