"""Serving benchmark: lowbit's engine against transformers ``generate``, on one GPU, in one run.

A Llama-3-8B-shaped model with **random weights** (built in memory: no download, and no
quality meaning; only speed is measured) runs as

* ``fp16``: unquantized weights, fp16 KV cache;
* ``w4g128``: 4-bit weights, group 128, asymmetric (random packed codes, scales and zero
  points, as a checkpoint stores them), fp16 KV cache;
* ``w4g128+kv-int4``: the same weights, INT4 KV cache (KIVI, the runtime's default groups);

through :class:`runtime.engine.Engine`, for prompts of 512 and 4096 tokens and 256 output
tokens at batch 1, 8 and 32 (all requests submitted at once), and a continuous-batching run of
64 requests arriving over time (Poisson arrivals, fixed seed). transformers' ``generate`` on the
same model shape in fp16 (greedy, fixed length) is the baseline: its TTFT is a 1-token
``generate``, its ITL (full run - TTFT) / (output - 1).

``smoke`` runs the same code on a tiny model on the CPU to check the script: its timings say
nothing about speed.
"""

from __future__ import annotations

import math
import random
import statistics
import time

import torch

from runtime.units import sync

LLAMA3_8B = dict(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=False,  # Meta-Llama-3-8B's config.json (no RoPE scaling: that is 3.1)
)
TINY = dict(
    model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=False,
)
CONFIGS = {  # name: (weights, KV scheme)
    "fp16": ("fp16", "fp16"),
    "w4g128": ("w4g128", "fp16"),
    "w4g128+kv-int4": ("w4g128", "int4"),
}


class NoGPUError(RuntimeError):
    pass


def require_cuda() -> torch.device:
    import os

    if not torch.cuda.is_available():
        raise NoGPUError("lowbit bench measures serving speed on a CUDA GPU and none is visible here "
                         f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); nothing was measured. "
                         "--smoke runs the benchmark's code on a tiny CPU model (its timings mean nothing).")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise NoGPUError("TRITON_INTERPRET=1 is set: the kernels would run in the interpreter; unset it to benchmark")
    return torch.device("cuda")


# ------------------------------------------------------------------------------- models


def random_model(config: dict, weights: str, kv: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A :class:`runtime.Model` of this shape with random weights (``fp16``, or ``w4g128``:
    every decoder Linear 4-bit, group 128, asymmetric; embeddings, norms and lm_head in ``dtype``)."""
    from pathlib import Path

    from kvquant import parse_kv
    from quant.affine import QuantScheme
    from runtime.linear import QuantLinear
    from runtime.load import Model, linear_factory, linear_names, prepare
    from runtime.model import Decoder, DecoderConfig

    cfg = DecoderConfig.from_hf(config)
    scheme = QuantScheme(bits=4, group_size=min(128, cfg.hidden_size), symmetric=False)
    names = [n for n in linear_names(cfg) if n != "lm_head"] if weights == "w4g128" else []
    with torch.device("meta"):
        decoder = Decoder(cfg, linear_factory({n: scheme for n in names}))
    g = torch.Generator(device).manual_seed(seed)
    state = {}
    for name, t in decoder.state_dict().items():
        if name.endswith("weight_shape"):
            continue  # set below, from the module
        if t.dtype == torch.int32:  # packed codes and zero points: any bits are valid codes
            state[name] = torch.randint(-2**31, 2**31 - 1, t.shape, dtype=torch.int32, device=device, generator=g)
        elif name.endswith("weight_scale"):
            state[name] = (torch.rand(t.shape, device=device, generator=g) * 0.004 + 0.001).to(dtype)
        elif "norm" in name:
            state[name] = torch.ones(t.shape, dtype=dtype, device=device)
        else:
            state[name] = (torch.randn(t.shape, device=device, generator=g, dtype=torch.float32) * 0.02).to(dtype)
    for name, module in decoder.named_modules():
        if isinstance(module, QuantLinear):
            state[f"{name}.weight_shape"] = torch.tensor([module.out_features, module.in_features])
    decoder.load_state_dict(state, assign=True)
    prepare(decoder, device, dtype)  # as runtime.load: joined projections, fused small ops on CUDA
    return Model(decoder, config, None, device, dtype, Path(f"random-{weights}"), parse_kv(kv))


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


# ------------------------------------------------------------------------------- timing


def _summary(values: list[float]) -> dict:
    values = sorted(v for v in values if v is not None)
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    p99 = values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]
    return {"mean": statistics.fmean(values), "p50": statistics.median(values), "p99": p99}


def engine_batch(engine, batch: int, prompt_len: int, output_len: int, seed: int) -> dict:
    """``batch`` requests submitted together, run to the end."""
    from runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    prompts = random_prompts(batch, prompt_len, engine.model.decoder.cfg.vocab_size, seed)
    sync(engine.model.device)
    start = time.perf_counter()
    requests = [engine.submit(p, params) for p in prompts]
    engine.run()
    sync(engine.model.device)
    wall = time.perf_counter() - start
    return _requests_result(requests, wall, batch=batch, prompt_len=prompt_len, output_len=output_len)


def bytes_per_step(engine, batch: int, prompt_len: int, output_len: int) -> float:
    """Bytes a decode step must read at least (weights as held, mean KV over the output): the
    bandwidth floor's numerator."""
    from evals.diagnose import kv_bytes_per_step, weight_bytes_per_step

    model = engine.model
    return weight_bytes_per_step(model, batch)[0] + kv_bytes_per_step(model, engine.scheme, batch, prompt_len,
                                                                        output_len)


def warm_up(engine, batches, prompt_lens, seed: int) -> None:
    """Triton compiles and autotunes per shape and row bucket: run every prompt length and batch
    once, briefly, so no measured case pays for it."""
    for prompt_len in prompt_lens:
        engine_batch(engine, 1, prompt_len, 2, seed + 1)
    for batch in batches:
        engine_batch(engine, batch, min(prompt_lens), 3, seed + 1)


def engine_arrivals(engine, requests: int, rate: float, prompt_len: int, output_len: int, seed: int) -> dict:
    """``requests`` requests arriving as a Poisson process of ``rate`` per second: each is submitted
    when its time comes, between engine steps (TTFT counts its wait)."""
    from runtime.sampling import SamplingParams

    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(rate)
        arrivals.append(t)
    prompts = random_prompts(requests, prompt_len, engine.model.decoder.cfg.vocab_size, seed)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    submitted, most_running = [], 0
    start = time.perf_counter()
    while len(submitted) < requests or engine.has_work():
        now = time.perf_counter() - start
        while len(submitted) < requests and arrivals[len(submitted)] <= now:
            submitted.append(engine.submit(prompts[len(submitted)], params))
        if engine.has_work():
            engine.step()
            most_running = max(most_running, len(engine.running))
        else:
            time.sleep(max(0.0, arrivals[len(submitted)] - now))
    sync(engine.model.device)
    wall = time.perf_counter() - start
    return _requests_result(submitted, wall, requests=requests, rate_per_s=rate, prompt_len=prompt_len,
                            output_len=output_len, most_running=most_running)


def _requests_result(finished, wall: float, **case) -> dict:
    out_tokens = sum(r.metrics.output_tokens for r in finished)
    return dict(
        **case, wall_s=wall, output_tokens=out_tokens, output_tokens_per_s=out_tokens / wall,
        ttft_s=_summary([r.metrics.ttft_s for r in finished]),
        itl_s=_summary([x for r in finished for x in r.metrics.itl_s]),
        e2e_s=_summary([r.metrics.e2e_s for r in finished]),
        preemptions=sum(r.metrics.preemptions for r in finished),
    )


def transformers_batch(model, batch: int, prompt_len: int, output_len: int, seed: int) -> dict:
    """transformers ``generate``, greedy, exactly ``output_len`` tokens (EOS ignored)."""
    device = model.device
    ids = torch.tensor(random_prompts(batch, prompt_len, model.config.vocab_size, seed), device=device)
    args = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def timed(n: int) -> float:
        sync(device)
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, **args)
        sync(device)
        return time.perf_counter() - start

    ttft, full = timed(1), timed(output_len)
    itl = (full - ttft) / max(output_len - 1, 1)
    return dict(batch=batch, prompt_len=prompt_len, output_len=output_len, wall_s=full,
                output_tokens=batch * output_len, output_tokens_per_s=batch * output_len / full,
                ttft_s={"mean": ttft}, itl_s={"mean": itl},
                method="TTFT: a 1-token generate; ITL: (full generate - TTFT) / (output_len - 1)")


def transformers_model(config: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf_config = LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})
    with torch.device(device):
        model = LlamaForCausalLM._from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


# --------------------------------------------------------------------------------- the run


def free_gpu(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def kv_budget(device: torch.device, reserve: int) -> int | None:
    """Free GPU memory after the weights, less ``reserve`` for activations and CUDA graphs
    (None on the CPU: the engine's default, room for every slot at full length)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return max(free - reserve, 0)


def run(smoke: bool = False, configs=tuple(CONFIGS), batches=(1, 8, 32), prompt_lens=(512, 4096), output_len=256,
        arrivals: int = 64, rate: float = 4.0, baseline: bool = True, prefill_chunk: int = 4096,
        reserve_bytes: int = 8 * 2**30, seed: int = 0, progress=print, on_row=None) -> dict:
    """Every case; returns the results record (with device, versions and commit). ``on_row(record)``
    is called after each case's row is added, so a caller cut off mid-run keeps the finished rows."""
    from evals.provenance import commit, provenance
    from runtime.engine import Engine

    on_row = on_row or (lambda record: None)

    code_version = commit()  # before the run: a commit made meanwhile cannot mislabel it
    if smoke:
        device, dtype, config = torch.device("cpu"), torch.float32, TINY
        batches, prompt_lens, output_len, arrivals, rate = (1, 2), (8, 24), 4, 4, 50.0
        kv_overrides = {"int4": "int4-g16-r16", "fp16": "fp16-r16"}
    else:
        device, dtype, config = require_cuda(), torch.float16, LLAMA3_8B
        kv_overrides = {}
    max_len = max(prompt_lens) + output_len
    max_batch = max(*batches, arrivals)
    started = time.time()
    record = {
        "benchmark": "lowbit bench (evals/serving.py)",
        "provenance": {**provenance(device), "commit": code_version},
        "smoke": smoke,
        "model": {"shape": "tiny" if smoke else "llama-3-8b", "config": config,
                  "weights": "random (built in memory; speed only, outputs are meaningless)", "dtype": str(dtype)},
        "method": ("engine: requests submitted together (batch) or as Poisson arrivals (continuous); greedy, "
                   "EOS ignored, exactly output_len tokens; TTFT from submit to first token; tokens/s = all "
                   "output tokens / wall time of the case"),
        "prefill_chunk": prefill_chunk, "engine": [], "transformers": [],
    }
    for name in configs:
        weights, kv = CONFIGS[name]
        progress(f"[{name}] building the model")
        model = random_model(config, weights, kv_overrides.get(kv, kv), device, dtype, seed)
        t0 = time.perf_counter()
        engine = Engine(model, kv_memory=kv_budget(device, reserve_bytes), max_batch=max_batch,
                        max_len=max_len, prefill_chunk=prefill_chunk)
        warm_up(engine, batches, prompt_lens, seed)
        startup = time.perf_counter() - t0
        info = {k: engine.stats()[k] for k in ("kv_scheme", "kv_budget_bytes", "num_blocks", "block_size",
                                              "max_batch", "capacity_tokens", "attention", "cuda_graph_buckets")}
        for prompt_len in prompt_lens:
            for batch in batches:
                result = engine_batch(engine, batch, prompt_len, output_len, seed)
                result["bytes_per_step"] = bytes_per_step(engine, batch, prompt_len, output_len)
                record["engine"].append({"config": name, **info, "startup_s": startup, **result})
                on_row(record)
                progress(f"[{name}] batch {batch} prompt {prompt_len}: {result['output_tokens_per_s']:.1f} tok/s, "
                         f"TTFT {result['ttft_s']['mean'] * 1e3:.1f} ms, ITL {_ms(result['itl_s']['mean'])} ms")
        if arrivals:
            result = engine_arrivals(engine, arrivals, rate, min(prompt_lens), output_len, seed)
            record["engine"].append({"config": name, "mode": "continuous", **info, "startup_s": startup, **result})
            on_row(record)
            progress(f"[{name}] {arrivals} arrivals at {rate}/s: {result['output_tokens_per_s']:.1f} tok/s, "
                     f"TTFT p50 {result['ttft_s']['p50'] * 1e3:.1f} ms, preemptions {result['preemptions']}")
        engine.shutdown()
        del engine, model
        free_gpu(device)
    if baseline:
        progress("[transformers fp16] building the model")
        hf = transformers_model(config, device, dtype, seed)
        transformers_batch(hf, 1, min(prompt_lens), 2, seed)  # warm-up
        for prompt_len in prompt_lens:
            for batch in batches:
                result = transformers_batch(hf, batch, prompt_len, output_len, seed)
                record["transformers"].append({"config": "transformers-fp16", **result})
                on_row(record)
                progress(f"[transformers fp16] batch {batch} prompt {prompt_len}: "
                         f"{result['output_tokens_per_s']:.1f} tok/s")
        del hf
        free_gpu(device)
    record["wall_s"] = time.time() - started
    return record


def _ms(seconds) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f}"


def table(record: dict) -> str:
    """Markdown: one row per case, the engine's and transformers'."""
    rows = ["| config | case | tok/s | TTFT mean (ms) | ITL mean (ms) | preemptions |", "|---|---|---|---|---|---|"]
    for r in record["engine"] + record["transformers"]:
        case = (f"{r['requests']} arrivals @ {r['rate_per_s']}/s, prompt {r['prompt_len']}" if "requests" in r
                else f"batch {r['batch']}, prompt {r['prompt_len']}")
        rows.append(f"| {r['config']} | {case}, out {r['output_len']} | {r['output_tokens_per_s']:.1f} | "
                    f"{_ms(r['ttft_s']['mean'])} | {_ms(r['itl_s']['mean'])} | {r.get('preemptions', '-')} |")
    return "\n".join(rows)
