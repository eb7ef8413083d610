"""CPU decode: the float model against W4 through the CPU kernels, and W4 with an INT4 KV cache
against W4 with an fp16 one, side by side in one run.

    flock /tmp/lowbit-bench.lock python -m bench.cpu_decode [--shapes smollm2-135m,llama-1b] [--steps 24]

Random weights at real shapes (SmolLM2-135M's config; a Llama-3.2-1B-shaped model): the float model
in the CPU default dtype (float32, ``runtime.load.default_dtype``) and W4 (group 64, asymmetric,
every decoder Linear; lm_head and embeddings unquantized, as lowbit's recipes leave them, kept in
bf16 as ``runtime.load`` keeps a bf16 checkpoint's on the CPU kernels), both through
``runtime.load.prepare``. ITL: the median of greedy decode steps of ``decoder(token, cache, pos)``
(as ``evals.speed.run_request`` times them) after a prompt of 32 tokens, at batch 1 and 8; the two
models are timed in alternating rounds so a busy machine slows both alike. Each step's process CPU
time is kept beside its wall time: with ``--threads 1`` it is the step's own work, which other jobs
on a shared machine do not stretch (the ratio to quote when the load average is above the cores). The KV comparison runs the
SmolLM2 shape at ``--kv-context`` tokens (prefilled, then decoded) with the fp16 and INT4 caches.
Also per layer shape: one quantized Linear's time through the int4 kernel (bf16 activations),
dense float32 and dense bf16 at M = 1, 8, 128, 512 (what picks the activation dtype and the
prefill path). Writes raw JSON with device, versions and commit to bench/results/cpu/.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # OpenMP as the lowbit CLI sets it: importing cli_options does, before torch loads
    import lowbit.cli_options  # noqa: F401  (not when bench.cpu_overhead imports this)

import torch  # noqa: E402

from bench.results_file import write_result  # noqa: E402
from evals.provenance import commit, cpu_name, versions

ROOT = Path(__file__).resolve().parent.parent

SHAPES = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                         tie_word_embeddings=True),
    "llama-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                     max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                     tie_word_embeddings=True),  # Llama-3.2-1B's shape (RoPE without its 3.1 scaling)
}
SCHEME = dict(bits=4, group_size=64, symmetric=False)


def random_model(config: dict, quantized: bool, kv: str = "fp16", seed: int = 0):
    """A runtime Model with random weights, their float ones stored in bf16 as Hub checkpoints keep
    them and converted as ``runtime.load`` does: float (float32) or W4 through the CPU kernels (its
    embedding and lm_head kept in bf16, ``runtime.load.narrow_float_weights``)."""
    from kvquant import parse_kv
    from quant.affine import QuantScheme
    from runtime.linear import QuantLinear
    from runtime.load import Model, linear_factory, linear_names, narrow_float_weights, prepare, to_compute_dtype
    from runtime.model import Decoder, DecoderConfig

    cfg = DecoderConfig.from_hf(config)
    names = [n for n in linear_names(cfg) if n != "lm_head"] if quantized else []
    with torch.device("meta"):
        decoder = Decoder(cfg, linear_factory({n: QuantScheme(**SCHEME) for n in names}))
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in decoder.state_dict().items():
        if t.dtype == torch.int32:  # packed codes and zero points: any bits are valid codes
            state[name] = torch.randint(-2**31, 2**31 - 1, t.shape, dtype=torch.int32, generator=g)
        elif name.endswith("weight_scale"):
            state[name] = torch.rand(t.shape, generator=g) * 0.004 + 0.001
        elif name.endswith("weight_shape"):
            state[name] = torch.tensor(t.shape)  # set below, from the module
        elif "norm" in name:
            state[name] = torch.ones(t.shape, dtype=torch.bfloat16)
        else:
            state[name] = (torch.randn(t.shape, generator=g) * 0.02).bfloat16()
    for name, module in decoder.named_modules():
        if isinstance(module, QuantLinear):
            state[f"{name}.weight_shape"] = torch.tensor([module.out_features, module.in_features])
    narrow = narrow_float_weights(decoder, torch.device("cpu"), cpu_kernels=True)
    decoder.load_state_dict(to_compute_dtype(state, torch.float32, cfg.tie_embeddings, narrow), assign=True)
    if cfg.tie_embeddings:
        decoder.lm_head.weight = decoder.model.embed_tokens.weight
    del state
    prepare(decoder, torch.device("cpu"), torch.float32, self_check=False, cpu_kernels=True)
    return Model(decoder, config, None, torch.device("cpu"), torch.float32, Path("random"), parse_kv(kv))


def itl(model, batch: int, prompt_len: int, steps: int, scheme=None) -> list[float]:
    """Wall seconds of each of ``steps`` greedy decode steps after a random prompt."""
    return [wall for wall, _ in step_times(model, batch, prompt_len, steps, scheme)]


def step_times(model, batch: int, prompt_len: int, steps: int, scheme=None) -> list[tuple[float, float]]:
    """(wall, process CPU) seconds of each greedy decode step of ``decoder(token, cache, pos)`` after a
    random prompt (as ``evals.speed.run_request`` times them). With one thread the CPU time is the
    step's own work, whatever else the machine runs; with more it adds what OpenMP's threads spend."""
    prompt = torch.randint(0, model.decoder.cfg.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(prompt_len + steps + 1, batch, scheme)  # None: the model's own scheme
    times = []
    with torch.inference_mode():
        token = model.decoder(prompt, cache, 0)[:, -1].argmax(-1, keepdim=True)
        for pos in range(prompt_len, prompt_len + steps):
            wall, cpu = time.perf_counter(), time.process_time()
            token = model.decoder(token, cache, pos)[:, -1].argmax(-1, keepdim=True)
            times.append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def prefill_seconds(model, tokens: int, clock=time.perf_counter) -> float:
    """Seconds of one forward of ``tokens`` prompt tokens into a fresh cache (batch 1) by ``clock``
    (wall by default; ``time.process_time`` for process CPU time)."""
    prompt = torch.randint(0, model.decoder.cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache(tokens + 1, 1)
    with torch.inference_mode():
        start = clock()
        model.decoder(prompt, cache, 0, last_only=True)
        return clock() - start


def summary(seconds: list[float], prefix: str) -> dict:
    ordered = sorted(seconds)
    return {f"median_{prefix}_ms": 1e3 * statistics.median(ordered), f"p10_{prefix}_ms": 1e3 * ordered[len(ordered) // 10],
            f"p90_{prefix}_ms": 1e3 * ordered[9 * len(ordered) // 10]}


def side_by_side(models: dict, batch: int, prompt_len: int, steps: int, rounds: int, schemes=None) -> dict:
    """Median ITL (wall) and median CPU time per step of each model, the models alternating round by round."""
    samples = {name: [] for name in models}
    for name, model in models.items():  # warm-up: first calls allocate and pick kernels
        step_times(model, batch, 8, 2, (schemes or {}).get(name))
    for _ in range(rounds):
        for name, model in models.items():
            samples[name] += step_times(model, batch, prompt_len, steps, (schemes or {}).get(name))
    return {name: {"median_itl_ms": 1e3 * statistics.median(w for w, _ in s), "steps": len(s),
                   **summary([w for w, _ in s], "wall"), **summary([c for _, c in s], "cpu")}
            for name, s in samples.items()}


def linear_times(n: int, k: int, repeats: int = 15) -> list[dict]:
    """One W4 g64 Linear: the int4 kernel (bf16 activations) against dense float32 and bf16."""
    from runtime import cpu_linear
    from quant.affine import QuantScheme
    from quant.packing import pack

    scheme = QuantScheme(**SCHEME)
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g)
    weight = cpu_linear.build(pack(q, 4, dim=1), torch.rand(n, k // 64, generator=g) * 0.01,
                              pack(torch.randint(-8, 8, (n, k // 64), dtype=torch.int8, generator=g), 4, dim=0),
                              (n, k), scheme)
    dense = torch.randn(n, k, generator=g)
    dense_bf16 = dense.bfloat16()
    rows = []
    for m in (1, 8, 128, 512):
        x = torch.randn(m, k, generator=g)
        xb = x.bfloat16()
        ways = {"int4_kernel_bf16": lambda: weight(x, None), "dense_fp32": lambda: x @ dense.t(),
                "dense_bf16": lambda: xb @ dense_bf16.t()}
        row = {"n": n, "k": k, "m": m}
        for name, f in ways.items():
            f()
            times = []
            for _ in range(repeats if m < 128 else 5):
                start = time.perf_counter()
                f()
                times.append(time.perf_counter() - start)
            row[f"{name}_ms"] = 1e3 * statistics.median(times)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-135m,llama-1b")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-context", type=int, default=4096)
    ap.add_argument("--skip-kv", action="store_true")
    ap.add_argument("--skip-linears", action="store_true", help="skip the one-Linear timings")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's, one per core)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu" / "cpu-decode.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    result = {"commit": commit(), "device": f"cpu: {cpu_name()}", "threads": torch.get_num_threads(),
              "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_"))},
              "versions": versions(), "protocol": __doc__.split("\n\n", 2)[2].strip(),
              "note": "a shared 2-core machine: other sessions' jobs may have run at the same time; "
                      "ratios are between models timed in alternating rounds of one run",
              "command": "python -m bench.cpu_decode " + " ".join(sys.argv[1:]), "load_average_start": os.getloadavg(),
              "decode": [], "kv": [], "linears": []}
    for shape in args.shapes.split(","):
        config = SHAPES[shape]
        models = {"float32": random_model(config, quantized=False), "w4": random_model(config, quantized=True)}
        for batch in (1, 8):
            row = {"shape": shape, "batch": batch, **side_by_side(models, batch, 32, args.steps, args.rounds)}
            row["w4_over_float"] = row["w4"]["median_itl_ms"] / row["float32"]["median_itl_ms"]
            row["w4_over_float_cpu_time"] = row["w4"]["median_cpu_ms"] / row["float32"]["median_cpu_ms"]
            row["load_average"] = os.getloadavg()[0]
            result["decode"].append(row)
            print(json.dumps(row), flush=True)
        del models
        gc.collect()
    if not args.skip_kv:
        from kvquant import parse_kv

        model = random_model(SHAPES["smollm2-135m"], quantized=True)
        schemes = {"w4_kv_fp16": parse_kv("fp16"), "w4_kv_int4": parse_kv("int4")}
        row = {"shape": "smollm2-135m", "batch": 1, "context": args.kv_context,
               **side_by_side({k: model for k in schemes}, 1, args.kv_context - args.steps - 1, args.steps, 1, schemes)}
        row["int4_over_fp16"] = row["w4_kv_int4"]["median_itl_ms"] / row["w4_kv_fp16"]["median_itl_ms"]
        result["kv"].append(row)
        print(json.dumps(row), flush=True)
    for n, k in () if args.skip_linears else ((1536, 576), (8192, 2048), (2048, 8192)):
        result["linears"] += linear_times(n, k)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
