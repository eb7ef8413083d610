"""bench/gpu_first.py's measuring steps: fp16 against W4 engines (``compare``) and decode attention
over more splits (``attention_splits``). Each runs inside one gpu_first step's child process and
reports its record after every row."""

from __future__ import annotations

import math
import statistics
import time

import torch

from runtime.units import sync

CONFIGS = ("fp16", "w4g128")  # evals.serving.CONFIGS names: fp16 KV cache both
TOP_KERNELS = 25


def compare(smoke: bool, case: dict, report=None) -> dict:
    """fp16 then W4 engines on ``case`` (batch, prompt_len, output_len, repeats, prefill_chunk),
    each tuning only the row buckets the case's steps take (``gpu_first.tune_rows``); their rows,
    and W4 against fp16."""
    from bench.gpu_first_plan import tune_rows
    from evals import serving

    device = torch.device("cpu") if smoke else serving.require_cuda()
    dtype, shape = (torch.float32, serving.TINY) if smoke else (torch.float16, serving.LLAMA3_8B)
    record = {"passed": False, "case": case, "shape": "tiny" if smoke else "llama-3-8b", "dtype": str(dtype),
              "tune_rows": tune_rows(case), "rows": []}
    for name in CONFIGS:
        record["rows"].append(engine_row(name, case, record["tune_rows"], device, dtype, shape, smoke))
        record["w4_vs_fp16"] = ratios(record["rows"])
        if report:
            report(record)
    return {**record, "passed": True}


def engine_row(name: str, case: dict, tune_rows, device, dtype, shape: dict, smoke: bool) -> dict:
    from evals import serving
    from runtime.engine import Engine
    from runtime.kernels import quant_matmul

    weights, kv = serving.CONFIGS[name]
    t0 = time.perf_counter()
    model = serving.random_model(shape, weights, "fp16-r16" if smoke else kv, device, dtype)
    built = time.perf_counter()
    engine = Engine(model, max_batch=case["batch"],  # KV cache: room for the case's sequences, no more
                    max_len=case["prompt_len"] + case["output_len"], prefill_chunk=case["prefill_chunk"],
                    tune_rows=tune_rows)
    started = time.perf_counter()
    tuned_at_start = len(quant_matmul._TUNED)
    serving.engine_batch(engine, case["batch"], case["prompt_len"], 2, seed=99)  # graphs' first replays, compiles
    warmed = time.perf_counter()
    repeats = [serving.engine_batch(engine, case["batch"], case["prompt_len"], case["output_len"], seed=r)
               for r in range(case["repeats"])]
    row = {"config": name, "model_build_s": built - t0, "startup_s": started - built, "warmup_s": warmed - started,
           "tuned_buckets": list(engine.tuned_buckets), "tunings_at_startup": tuned_at_start,
           "tunings_after_start": len(quant_matmul._TUNED) - tuned_at_start,  # > 0: a timed step met a new bucket
           "cuda_graph_buckets": engine.stats()["cuda_graph_buckets"], "repeats": repeats,
           "ttft_s": serving._summary([r["ttft_s"]["mean"] for r in repeats]),
           "itl_s": {"mean": statistics.fmean(r["itl_s"]["mean"] for r in repeats),  # over the repeats:
                     "p50": statistics.median(r["itl_s"]["p50"] for r in repeats),  # median of their p50s,
                     "p99": max(r["itl_s"]["p99"] for r in repeats)},  # the worst p99
           "itl_mean_s": statistics.fmean(r["itl_s"]["mean"] for r in repeats),
           "output_tokens_per_s": max(r["output_tokens_per_s"] for r in repeats)}
    if case["batch"] == 1:
        row["profile"] = profile_steps(engine, case["prompt_len"], device)
    print(f"[{name}] start-up {row['startup_s']:.1f} s, TTFT {row['ttft_s']['p50'] * 1e3:.1f} ms, "
          f"ITL {row['itl_mean_s'] * 1e3:.2f} ms ({case['batch']} x {case['prompt_len']} + {case['output_len']})",
          flush=True)
    engine.shutdown()
    del engine, model
    serving.free_gpu(device)
    return row


def ratios(rows: list[dict]) -> dict | None:
    """W4 against fp16: ITL speed-up (fp16 ITL / W4 ITL, mean over the repeats) and TTFT ratio
    (W4 / fp16, median over the repeats)."""
    by = {r["config"]: r for r in rows}
    if not set(CONFIGS) <= set(by):
        return None
    fp16, w4 = by["fp16"], by["w4g128"]
    return {"itl_speedup": fp16["itl_mean_s"] / w4["itl_mean_s"], "ttft_ratio": w4["ttft_s"]["p50"] /
            fp16["ttft_s"]["p50"], "startup_s": {"fp16": fp16["startup_s"], "w4g128": w4["startup_s"]}}


def profile_steps(engine, prompt_len: int, device) -> dict:
    """One request's prefill step, a decode step as it runs (CUDA graph replay), and one decode
    step launched eagerly (the graph's kernels one by one), each profiled: time per kernel."""
    from runtime.sampling import SamplingParams
    from evals.serving import random_prompts

    prompt = random_prompts(1, prompt_len, engine.model.decoder.cfg.vocab_size, seed=7)[0]
    engine.submit(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    out = {"prefill": profiled(engine.step, device), "decode": profiled(engine.step, device)}
    graphs, engine.executor.graphs = engine.executor.graphs, None  # the same step, eagerly
    try:
        out["decode_eager"] = profiled(engine.step, device)
    finally:
        engine.executor.graphs = graphs
    engine.run()
    return out


def profiled(fn, device) -> dict:
    """``fn()`` under torch.profiler: wall time, and the top kernels by device time (CPU: ops by
    self CPU time), each with calls and total microseconds."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        start = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - start
    events = []
    for e in prof.key_averages():
        if cuda and e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            events.append({"name": e.key[:160], "calls": e.count, "us": round(us, 1)})
    events.sort(key=lambda r: -r["us"])
    return {"wall_ms": wall * 1e3, "device_us": round(sum(r["us"] for r in events), 1),
            "what": "kernels by device time" if cuda else "ops by self CPU time", "top": events[:TOP_KERNELS]}


# ------------------------------------------------------------------------------- attention


def attention_splits(smoke: bool, report=None) -> dict:
    """Decode attention at CONTEXT tokens, batch 1 and 32, over fp16/int8/int4 paged caches, at
    SPLIT_FACTORS times the default split count (``kernels.attention``'s), against fp16 SDPA over the
    dense cache; each result checked against SDPA over the dequantized cache first."""
    import torch.nn.functional as F

    from bench import attention as ab
    from bench.gpu import median_seconds_per_call
    from bench.gpu_first_plan import CONTEXT, SPLIT_FACTORS
    from kvquant import parse_kv
    from runtime.kernels import attention as kernels
    from runtime.kernels import kv_reference as ref

    device = torch.device("cpu" if smoke else "cuda")
    shape = ({**ab.SMOKE} if smoke else {"q_heads": 32, "kv_heads": 8, "head_dim": 128, "block": ""})
    batches, context, samples = ((1,), 96, 1) if smoke else ((1, 32), CONTEXT, 10)  # smoke: 3 blocks of 32
    factors = SPLIT_FACTORS[:2] if smoke else SPLIT_FACTORS
    rows = []
    for batch in batches:
        hq, hkv, d = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
        gen = torch.Generator(device=device).manual_seed(batch)
        k, v = (torch.randn(batch, hkv, context, d, device=device, generator=gen).half() for _ in range(2))
        q = torch.randn(batch, hq, d, device=device, generator=gen).half()
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        n = ab.copies_for(ab.nbytes(k, v), device)
        dense = [(k, v)] + [(k.clone(), v.clone()) for _ in range(n - 1)]
        t, _ = median_seconds_per_call([lambda kv=kv: F.scaled_dot_product_attention(
            q[:, :, None], kv[0], kv[1], enable_gqa=True) for kv in dense], samples, device)
        base = {"batch": batch, "context": context, "path": "sdpa-fp16", "us": t * 1e6}
        rows.append(base)
        del dense
        for name in ("fp16", "int8", "int4"):
            scheme = parse_kv(name + shape.get("block", ""))
            paged = ab.build_paged(scheme, k, v, seed=context)
            copies = [paged] + [ab.build_paged(scheme, k, v, seed=context + i)
                                for i in range(1, ab.copies_for(ab.paged_bytes(paged, context), device))]
            dk, dv = kernels.dequantize_cache(paged, lens, context)
            want = F.scaled_dot_product_attention(q[:, :, None], dk, dv, enable_gqa=True)[:, :, 0]
            del dk, dv
            S, H, block, _ = paged.residual_k.shape  # as decode_attention sizes its default split
            default = ref.num_splits(context, block, S * H, target=2 * kernels._sm_count(device),
                                     max_splits=kernels.MAX_SPLITS)
            for factor in factors:
                splits = default * factor
                err = float((kernels.decode_attention(q, paged, lens, max_seq_len=context, num_splits=splits).float()
                             - want.float()).abs().max())
                t, graphed = median_seconds_per_call([lambda p=p: kernels.decode_attention(
                    q, p, lens, max_seq_len=context, num_splits=splits) for p in copies], samples, device)
                rows.append({"batch": batch, "context": context, "path": f"fused-{name}", "scheme": scheme.name,
                             "split_factor": factor, "splits_asked": splits,
                             "splits_run": effective_splits(context, block, splits, kernels.MAX_SPLITS),
                             "us": t * 1e6, "cuda_graph": graphed, "max_abs_err": err,
                             "speedup_vs_sdpa_fp16": base["us"] / (t * 1e6),
                             "gb_per_s": (ab.paged_bytes(paged, context) + 2 * ab.nbytes(q)) / t / 1e9})
            del copies, paged
            if report:
                report({"passed": True, "rows": rows, "max_splits": kernels.MAX_SPLITS})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"passed": True, "rows": rows, "max_splits": kernels.MAX_SPLITS}


def effective_splits(context: int, block: int, asked: int, cap: int) -> int:
    """The parts ``decode_attention`` splits a sequence into when asked for ``asked``: capped at
    ``cap`` and the block count, then evened out (whole blocks a part)."""
    blocks = max(math.ceil(context / block), 1)
    per_split = math.ceil(blocks / max(1, min(asked, blocks, cap)))
    return math.ceil(blocks / per_split)
