"""Correctness of the GPU path on the hardware, against float64 references (bench/gpu_check.py's
``weights``, ``attention`` and ``engine`` stages).

Every check draws fresh random inputs (never zeros) and poisons the memory an output will land
in first: the caching allocator hands a freed block of the same size to the next allocation, so
the output buffer a kernel allocates starts as NaN, and an element it never writes fails the
check. Errors are ``‖out − ref‖ / ‖ref‖`` against a float64 reference of the same quantized
values, within ``runtime.tolerances``' bounds (the load-time self-check holds the kernels to the same).

What the checks do NOT cover, to keep compilation (the cost on the lent GPU: a second or two of
CPU per kernel variant) within a stage's budget: the weight check runs two fixed launch
configurations per M regime (``launch_configs``), not the autotuner's ~17 candidates (at run time
the tuner checks its own winner against a float64 reference before first use:
``runtime/kernels/matmul_tuning.py``); the engine check runs every GEMM on its untimed default
configuration (tuning switched off), since its point is the engine's paths, not the GEMM's.

``shard=(i, n)`` runs every n-th case from the i-th (each case keeps its global index, hence its
seed: the shards together are exactly the whole check), so gpu_check can spread the compilation
over processes; ``on_result`` is called with the summary so far after each case (gpu_check keeps
it when a stage runs out of time).

With ``smoke`` the same code runs on CPU tensors through the Triton interpreter on tiny shapes
(fp16 only: the interpreter cannot run bf16 kernels); it checks the script, not the hardware.
"""

from __future__ import annotations

import contextlib
import random
from unittest import mock

import torch
import torch.nn.functional as F

from runtime.tolerances import REL_ERROR_BOUND, poison, rel_error


def device_for(smoke: bool) -> torch.device:
    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible: run with --smoke to check the script on CPU")
    return torch.device("cuda")


def sharded(cases: list, shard: tuple[int, int]) -> list[tuple[int, object]]:
    """(global index, case) of every n-th case from the i-th."""
    i, n = shard
    if not 0 <= i < n:
        raise ValueError(f"shard {i} of {n}: want 0 <= i < n")
    return [(k, case) for k, case in enumerate(cases) if k % n == i]


def summarize(results: list[dict], **extra) -> dict:
    failed = [r for r in results if not r["passed"]]
    worst = [r["rel_error"] for r in results if "rel_error" in r]
    return {"passed": not failed, "cases": len(results), "failed": failed[:20], "results": results,
            **({"worst_rel_error": max(worst)} if worst else {}), **extra}


# ------------------------------------------------------------------------------ weight kernels


def weight_cases(smoke: bool) -> list[dict]:
    """bits x dtype x (sym g128, asym g64, asym per-channel, asym g128 act-order) x M. N is not a
    multiple of any tile; K is not a multiple of 128 wherever the group allows (g64, per channel)."""
    dtypes = [torch.float16] if smoke else [torch.float16, torch.bfloat16]
    schemes = [("sym-g128", 128, True, False), ("asym-g64", 64, False, False),
               ("asym-channel", -1, False, False), ("asym-g128-actorder", 128, False, True)]
    rows = [1, 3, 17] if smoke else [1, 3, 16, 17, 300]
    n = 72 if smoke else 4104  # 4096 + 8
    odd_k, k128 = (320, 384) if smoke else (4160, 4224)  # 32.5 x 128; 33 x 128
    return [dict(bits=bits, dtype=dtype, scheme=name, group=group, sym=sym, act_order=act_order, rows=rows, n=n,
                 k=k128 if group == 128 else odd_k)
            for bits in (4, 8) for dtype in dtypes for name, group, sym, act_order in schemes]


def quantized_linear(case: dict, device: torch.device, seed: int):
    """A random Linear through quant's own math, stored as a checkpoint stores it, then re-laid for
    the kernels; returns (kernel weight, float64 dequantized weight as the kernel must see it)."""
    from quant.affine import QuantScheme, choose_qparams, quantize
    from quant.packing import pack
    from runtime.kernels import reference
    from runtime.kernels.weight_layout import make_kernel_weight

    g = torch.Generator().manual_seed(seed)
    n, k = case["n"], case["k"]
    scheme = QuantScheme(case["bits"], case["group"], case["sym"])
    weight = torch.randn(n, k, generator=g) * 0.05
    g_idx = None
    if case["act_order"]:  # GPTQ act-order: group j holds a random set of columns
        perm = torch.randperm(k, generator=g)
        scale, zero = choose_qparams(weight[:, perm], scheme, scale_dtype=case["dtype"])
        q = quantize(weight[:, perm], scale, zero, scheme)[:, torch.argsort(perm)]
        g_idx = (torch.arange(k) // scheme.group_len(k))[torch.argsort(perm)].to(torch.int32)
    else:
        scale, zero = choose_qparams(weight, scheme, scale_dtype=case["dtype"])
        q = quantize(weight, scale, zero, scheme)
    packed = pack(q, scheme.bits, dim=1)
    zero_packed = None if zero is None else pack(zero, scheme.bits, dim=0)
    dense = reference.dequantize_weight(packed, scale, zero_packed, (n, k), scheme, case["dtype"], g_idx)
    to = (lambda t: None if t is None else t.to(device))  # noqa: E731
    kw = make_kernel_weight(to(packed), to(scale), to(zero_packed), (n, k), scheme, to(g_idx))
    return kw, dense.double()


def launch_configs(M: int, kw, dtype=None) -> list[tuple[str, object]]:
    """The launch configurations the weight check runs for M rows: the untimed default of M's regime
    (``matmul_configs.candidate_configs``' first, what runs where nothing is tuned), the first
    candidate with other tile sizes (another tile shape, split and masking through the same kernel)
    and, where the tuner may pick it (2..8 rows), the first few-row GEMV (runtime/kernels/gemv_rows.py)."""
    from runtime.kernels.matmul_configs import candidate_configs

    candidates = candidate_configs(M, kw, dtype)
    default = candidates[0]
    other = next((c for c in candidates[1:] if (c.block_m, c.block_n) != (default.block_m, default.block_n)
                  and c.use_dot == default.use_dot and not getattr(c, "dense", False)), None)
    rows = next((c for c in candidates if not c.use_dot and c.block_m > 1 and not c.dense), None)
    return ([("default", default)] + ([("other-tiles", other)] if other else [])
            + ([("gemv-rows", rows)] if rows else []))


def check_weights(smoke: bool = False, seed: int = 0, shard: tuple[int, int] = (0, 1), on_result=None) -> dict:
    """Every case at every M through ``launch_configs`` (fixed configurations, no autotuning)."""
    from runtime.kernels.quant_matmul import quant_matmul

    device = device_for(smoke)
    results = []
    for i, case in sharded(weight_cases(smoke), shard):
        kw, dense = quantized_linear(case, device, seed + i)
        bias = torch.randn(case["n"], generator=torch.Generator().manual_seed(seed + i)).to(case["dtype"])
        for M in case["rows"]:
            x = torch.randn(M, case["k"], generator=torch.Generator().manual_seed(seed + 1000 * i + M))
            x = x.to(case["dtype"])
            ref = x.double() @ dense.T + bias.double()
            for label, config in launch_configs(M, kw, case["dtype"]):
                if smoke and label == "gemv-rows":  # interpreted, it costs CI ~10 s a case; tested on its
                    continue  # own in tests/test_kernels_gemv_rows.py
                poison(M * case["n"], case["dtype"], device)
                out = quant_matmul(x.to(device), kw, bias.to(device), config=config).cpu()
                err = rel_error(out, ref)
                bound = REL_ERROR_BOUND[case["dtype"]]
                results.append({"bits": case["bits"], "dtype": str(case["dtype"]).removeprefix("torch."),
                                "scheme": case["scheme"], "M": M, "N": case["n"], "K": case["k"], "config": label,
                                "launch": str(config), "rel_error": err, "bound": bound, "passed": err <= bound})
        if on_result:
            on_result(summarize(results))
    return summarize(results)


# --------------------------------------------------------------------------- decode attention


def attention_cases(smoke: bool) -> list[dict]:
    """Every scheme x (GQA 4:1, 1:1) x (no window, a window shorter than the longest sequence);
    smoke (the interpreter is slow) pairs the window with 1:1 only."""
    schemes = ["fp16", "fp8", "int8", "int4", "int2"]
    if smoke:  # blocks of 16 keep the tiny sequences several blocks long
        return [dict(kv=s + ("-g16-r32" if s.startswith("int") else "-r32"), hq=hq, hkv=hkv, d=64, window=w)
                for s in schemes for hq, hkv, w in ((4, 1, None), (2, 2, 40))]
    return [dict(kv=s, hq=hq, hkv=hkv, d=128, window=w)  # the runtime's default blocks
            for s in schemes for hq, hkv in ((32, 8), (8, 8)) for w in (None, 300)]


def sequence_lengths(block: int, smoke: bool) -> list[int]:
    """Per-sequence lengths around block boundaries: one token, a block less one, whole blocks
    plus a residual, and a long one."""
    return [1, block - 1, 3 * block + 5, 2 * block, 4 * block + 7] if smoke else \
        [1, block - 1, 3 * block + 5, 8 * block, 4000]


def attention_reference(q: torch.Tensor, paged, lens: list[int], window: int | None) -> torch.Tensor:
    """float64 attention over the cache's stored values (kv_reference.read_sequence dequantizes)."""
    from runtime.kernels.kv_reference import read_sequence

    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // paged.residual_k.shape[1]
    for s, n in enumerate(lens):
        lo = max(n - window, 0) if window else 0
        k = read_sequence(paged, s, n, True)[:, lo:].double().cpu().repeat_interleave(group, 0)
        v = read_sequence(paged, s, n, False)[:, lo:].double().cpu().repeat_interleave(group, 0)
        qs = q[s].double().cpu()[:, None]  # [Hq, 1, D]
        att = torch.softmax(qs @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        out[s] = (att @ v)[:, 0]
    return out


def filled_caches(case: dict, lens: list[int], device: torch.device, seed: int):
    """Two paged caches with one random block table, each sequence written with its own length:
    by the quantize-on-write kernel on ``device`` and by kv_reference on the CPU."""
    from kvquant import parse_kv
    from runtime.cache import KVCache
    from runtime.kernels import attention as kernels
    from runtime.kernels import kv_reference as ref
    from runtime.kernels.kv_reference import PagedKV

    scheme = parse_kv(case["kv"])
    S, H, D = len(lens), case["hkv"], case["d"]
    max_len = -(-max(lens) // scheme.block_size) * scheme.block_size + scheme.block_size
    caches = [KVCache(1, S, H, D, max_len, torch.float16, dev, scheme=scheme) for dev in (device, "cpu")]
    table = torch.randperm(caches[0].block_table.numel(), generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    for cache in caches:
        cache.block_table.copy_(table.view_as(cache.block_table))
    fused, truth = (PagedKV.from_cache(c, 0) for c in caches)
    for s, n in enumerate(lens):
        k = torch.randn(1, H, n, D, generator=g)
        k[..., :: max(D // 8, 1)] += 4.0  # persistent key channels, as LLMs make them
        v = torch.randn(1, H, n, D, generator=g)
        k, v = k.half(), v.half()
        for paged, write, dev in ((fused, kernels.write_kv, device), (truth, ref.write_kv, "cpu")):
            one = PagedKV(paged.k, paged.v, paged.residual_k[s:s + 1], paged.residual_v[s:s + 1],
                          paged.block_table[s:s + 1], paged.scheme)
            write(one, torch.zeros(1, dtype=torch.int32, device=dev), k.to(dev), v.to(dev))
    return fused, truth


def same_cache(a, b) -> bool:
    """Bit-identical pools and residuals (fp8 compared as bytes: -0 and 0 differ)."""
    for got, want in ((a.k, b.k), (a.v, b.v)):
        for x, y in zip(got, want):
            if x is None:
                continue
            x, y = x.cpu(), y.cpu()
            if x.dtype == torch.float8_e4m3fn:
                x, y = x.view(torch.uint8), y.view(torch.uint8)
            if not torch.equal(x, y):
                return False
    return torch.equal(a.residual_k.cpu(), b.residual_k.cpu()) and torch.equal(a.residual_v.cpu(), b.residual_v.cpu())


def check_attention(smoke: bool = False, seed: int = 0, shard: tuple[int, int] = (0, 1), on_result=None) -> dict:
    from kvquant import parse_kv
    from runtime.kernels import attention as kernels

    device = device_for(smoke)
    results = []
    for i, case in sharded(attention_cases(smoke), shard):
        lens = sequence_lengths(parse_kv(case["kv"]).block_size, smoke)
        fused, truth = filled_caches(case, lens, device, seed + i)
        q = torch.randn(len(lens), case["hq"], case["d"], generator=torch.Generator().manual_seed(seed + 7 * i))
        q = q.half()
        poison(q.numel(), torch.float16, device)
        out = kernels.decode_attention(q.to(device), fused, torch.tensor(lens, dtype=torch.int32, device=device),
                                       window=case["window"], max_seq_len=max(lens)).cpu()
        err = rel_error(out, attention_reference(q, truth, lens, case["window"]))
        bound = REL_ERROR_BOUND[torch.float16]
        written = same_cache(fused, truth)
        results.append({**case, "lens": lens, "rel_error": err, "bound": bound, "write_bit_identical": written,
                        "passed": err <= bound and written})
        if on_result:
            on_result(summarize(results))
    return summarize(results)


# ------------------------------------------------------------------------------------- engine


def engine_models(smoke: bool) -> list[tuple[str, dict]]:
    """A small random Llama (GQA 4:1) and a random Mistral with a sliding window (GQA 2:1)."""
    from evals.serving import TINY

    if smoke:
        llama = {**TINY}
        mistral = {**TINY, "model_type": "mistral", "sliding_window": 24}
    else:
        llama = dict(TINY, vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
        mistral = dict(llama, model_type="mistral", num_key_value_heads=4, sliding_window=96)
    return [("llama-gqa4", llama), ("mistral-window", mistral)]


def first_real_divergence(model, prompt: list[int], a: list[int], b: list[int], tolerance: float):
    """Index of the first differing greedy token whose reference top-2 logit gap exceeds
    ``tolerance`` (a near-tie may flip on any hardware), or None when the sequences agree."""
    for t, (x, y) in enumerate(zip(a, b)):
        if x == y:
            continue
        ids = torch.tensor([prompt + a[:t]], device=model.device)
        top = model.logits(ids)[0, -1].float().topk(2).values
        return None if float(top[0] - top[1]) <= tolerance else t
    return None if len(a) == len(b) else min(len(a), len(b))


def engine_grid(smoke: bool) -> list[tuple[str, dict, str, str]]:
    """(model name, config, weights, cache) cases: every weight x cache pair on both models, or
    in smoke (the interpreter is slow) three pairs that still cover both models, W4 and INT4."""
    kv_names = {"fp16": "fp16-r16", "int8": "int8-r16", "int4": "int4-g16-r16"} if smoke else \
        {"fp16": "fp16", "int8": "int8", "int4": "int4"}
    (llama_name, llama), (mistral_name, mistral) = engine_models(smoke)
    if smoke:
        pairs = [(llama_name, llama, "fp16", "fp16"), (llama_name, llama, "w4g128", "int4"),
                 (mistral_name, mistral, "w4g128", "int8")]
    else:
        pairs = [(name, config, w, kv) for name, config in ((llama_name, llama), (mistral_name, mistral))
                 for w in ("fp16", "w4g128") for kv in ("fp16", "int8", "int4")]
    return [(name, config, w, kv_names[kv]) for name, config, w, kv in pairs]


def greedy_outputs(model, prompts: list[list[int]], new: int, chunk: int, options: dict) -> list[list[int]]:
    from runtime.engine import Engine
    from runtime.sampling import SamplingParams

    engine = Engine(model, max_batch=len(prompts), max_len=max(map(len, prompts)) + new, prefill_chunk=chunk,
                    **options)
    try:
        return [r.output_ids for r in engine.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))]
    finally:
        engine.shutdown()


def check_engine(smoke: bool = False, seed: int = 0, shard: tuple[int, int] = (0, 1), on_result=None) -> dict:
    """Greedy tokens of the engine with CUDA graphs, without, and with the reference attention
    path, for fp16 and W4 weights and fp16/INT8/INT4 caches, on a prompt mix that crosses blocks
    and prefill chunks; a difference passes only where the float model's top-2 logits were within
    ``tolerance`` (exact equality flakes on hardware). The W4 GEMMs run their untimed default
    configurations: GEMM tuning is switched off here (``quant_matmul.tunes_on``), since an Engine
    would otherwise time ~17 candidates for every Linear shape at each of its 20 M buckets (100
    tunings, 81 compiles: ``python -m bench.gpu_compiles``) and this check is about the engine."""
    from evals.serving import random_model
    from runtime.kernels import quant_matmul

    device = device_for(smoke)
    dtype = torch.float32 if smoke else torch.float16
    tolerance = 1e-3 if smoke else 5e-2
    variants = {"triton-eager": dict(attention="triton", cuda_graphs=False)}
    if device.type == "cuda":
        variants["triton-graphs"] = dict(attention="triton", cuda_graphs=True)
    lengths, new, chunk = ([5, 19, 40], 6, 16) if smoke else ([7, 130, 300, 517], 48, 256)
    results = []
    untuned = mock.patch.object(quant_matmul, "tunes_on", lambda device: False)
    with untuned if device.type == "cuda" else contextlib.nullcontext():
        for i, (model_name, config, weights, kv) in sharded(engine_grid(smoke), shard):
            model = random_model(config, weights, kv, device, dtype, seed)
            rng = random.Random(seed + i)
            prompts = [[rng.randrange(config["vocab_size"]) for _ in range(n)] for n in lengths]
            want = greedy_outputs(model, prompts, new, chunk, dict(attention="reference", cuda_graphs=False))
            for name, options in variants.items():
                got = greedy_outputs(model, prompts, new, chunk, options)
                bad = [first_real_divergence(model, p, a, b, tolerance) for p, a, b in zip(prompts, want, got)]
                results.append({"model": model_name, "weights": weights, "kv": kv, "variant": name,
                                "vs": "reference", "tokens": sum(map(len, got)), "diverged_at": bad,
                                "passed": all(b is None for b in bad)})
            del model
            if on_result:
                on_result(summarize(results, tolerance=tolerance, graphs_checked="triton-graphs" in variants))
    return summarize(results, tolerance=tolerance, graphs_checked="triton-graphs" in variants)
