"""What bench/gpu_first.py's run does, worked out without a GPU: its cases, the rows each Engine
tunes, the tunings and compiles they make (counted on CPU), and so which kernels the carried Triton
cache must hold. Its own module so that gpu_first, its engine steps (gpu_first_engine) and the cache
builder (gpu_cache) all read it without importing each other in a circle."""

from __future__ import annotations

ENGINE = dict(batch=1, prompt_len=512, output_len=128, repeats=3, prefill_chunk=512)
BATCH32 = dict(batch=32, prompt_len=512, output_len=128, repeats=1, prefill_chunk=4096)
SMOKE_ENGINE = dict(batch=1, prompt_len=24, output_len=4, repeats=2, prefill_chunk=24)
PREFILL_ROWS, SMALL_ROWS = (512, 4096), (4, 8, 16)
SPLIT_FACTORS, CONTEXT = (1, 2, 4, 8), 32768


# ------------------------------------------------------------------------------- what runs


def step_rows(batch: int, prompt_len: int, prefill_chunk: int) -> tuple[int, ...]:
    """The rows of every forward an Engine runs for ``batch`` prompts submitted together: packed
    prefills of up to ``prefill_chunk`` tokens, then the decode batch, which grows as prompts finish
    (a sequence decodes from the step after its prefill). For prompts no longer than a chunk (the
    scheduler also cuts a longer prompt at the chunk's multiples: not modelled here)."""
    if prompt_len > prefill_chunk:
        raise ValueError(f"step_rows models prompts of at most prefill_chunk ({prefill_chunk}) tokens, "
                         f"got {prompt_len}")
    left, decoding, rows = [prompt_len] * batch, 0, set()
    while any(left):
        budget, finished = prefill_chunk, 0
        for i, n in enumerate(left):
            take = min(n, budget)
            left[i], budget = n - take, budget - take
            finished += n > 0 and left[i] == 0
        rows.add(prefill_chunk - budget)
        if decoding:
            rows.add(decoding)
        decoding += finished
    return tuple(sorted(rows | {decoding}))


def tune_rows(case: dict) -> tuple[int, ...]:
    """What an Engine for ``case`` is told to tune (``Engine(tune_rows=...)``): its steps' rows
    (``step_rows``) and the batch buckets its CUDA graphs capture (each capture's warm-up runs its
    bucket's step, tuning it then if not before)."""
    import inspect

    from runtime.execution import DecodeGraphs

    graphs = inspect.signature(DecodeGraphs).parameters["buckets"].default
    return tuple(sorted(set(step_rows(case["batch"], case["prompt_len"], case["prefill_chunk"]))
                        | {b for b in graphs if b <= case["batch"]}))


def engine_shapes(config=None) -> list[str]:
    """The engine model's quantized Linear shapes as bench/kernels.py takes them (``KxN``)."""
    from bench.gpu_compiles import meta_linears
    from evals.serving import LLAMA3_8B

    return [f"{kw.in_features}x{kw.out_features}" for kw in meta_linears(config or LLAMA3_8B)]


def tuning_counts() -> dict:
    """Tunings, timed candidates and matmul compiles of each step that tunes, counted without a GPU
    (``bench.gpu_compiles.recording``), with their compile tasks; beside them the engine as it tuned
    before ``tune_rows`` (every bucket to max(max_batch, prefill_chunk))."""
    import torch

    from bench import gpu_compiles as gc
    from evals.serving import LLAMA3_8B
    from runtime.kernels.quant_matmul import choose_config

    weights = gc.meta_linears(LLAMA3_8B)

    def counted(run) -> dict:
        with gc.recording() as counts:
            run()
        return gc.summary(counts)

    def engine(case, restricted=True):
        largest = max(case["batch"], case["prefill_chunk"])
        rows = tune_rows(case) if restricted else None
        return lambda: gc.engine_start_up(weights, largest, rows=rows)

    def kernels(rows):
        return lambda: [choose_config(M, kw, torch.float16, torch.device("meta")) for kw in weights for M in rows]

    return {"engine": counted(engine(ENGINE)), "engine, every bucket": counted(engine(ENGINE, False)),
            "batch32": counted(engine(BATCH32)), "batch32, every bucket": counted(engine(BATCH32, False)),
            "prefill": counted(kernels(PREFILL_ROWS)), "small-m": counted(kernels(SMALL_ROWS))}


def compile_tasks_of_run() -> list:
    """Every quantized-matmul compile the GPU run makes (the steps' tunings), each once."""
    seen, tasks = set(), []
    for name, counts in tuning_counts().items():
        for task in counts["tasks"] if "every bucket" not in name else ():
            key = repr(task)
            if key not in seen:
                seen.add(key)
                tasks.append(task)
    return tasks
