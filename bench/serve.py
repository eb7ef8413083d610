"""What HTTP costs: the same load through ``lowbit serve`` (the ``openai`` client, streaming) and
driven in-process on a ``runtime.Engine``, at 1, 8 and 32 concurrent clients.

    python -m bench.serve [--model smollm2-135m] [--kv fp16] [--kv-memory 1GB] [--clients 1,8,32]
                          [--requests 2] [--prompt-len 128] [--output-len 32] [--json OUT]

Load (both sides): closed loop; each of ``clients`` clients sends ``requests`` requests one after
another (random token-id prompts of ``prompt-len``, greedy, exactly ``output-len`` tokens with
``ignore_eos``). The server runs as its own process (``lowbit serve``, ``--max-batch`` the most
clients, the same KV budget as the in-process engine, stepped in a thread of its own as the
server steps it); the clients run here.

Per request: TTFT (client: request sent to first text chunk; in-process: submit to first token)
and mean ITL (first to last token over the tokens between). Per level: requests/s, output
tokens/s, TTFT and ITL percentiles, and HTTP / in-process ratios. Writes raw JSON with device,
versions and commit (default ``bench/results/serve/http-overhead-<device>-<commit>.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

if not __package__:  # `python bench/serve.py`: Python put bench/ first on the path, where its kernels.py
    # shadows the `kernels` package transformers looks for (ImportError at `import transformers`)
    here = Path(__file__).resolve().parent
    sys.path[:] = [str(here.parent)] + [p for p in sys.path if Path(p or ".").resolve() != here]

from bench.results_file import write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def prompts_for(clients: int, requests: int, length: int, vocab: int, seed: int) -> list[list[list[int]]]:
    """Each client's prompts (token ids, the same on both sides)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (clients, requests, length), generator=g)
    return ids.tolist()


def percentiles(values: list[float]) -> dict:
    values = sorted(v for v in values if v is not None)
    if not values:
        return {}

    def at(q):
        return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": statistics.fmean(values)}


def summary(records: list[dict], wall: float) -> dict:
    tokens = sum(r["tokens"] for r in records)
    return {"requests": len(records), "wall_s": wall, "requests_per_s": len(records) / wall,
            "output_tokens_per_s": tokens / wall, "ttft_s": percentiles([r["ttft"] for r in records]),
            "itl_s": percentiles([r["itl"] for r in records])}


# ------------------------------------------------------------------------------ in-process


def in_process(engine, prompts, output_len: int) -> dict:
    """Every client's requests through ``engine``, stepped in a thread of its own as the server
    steps it: on the 2-core development CPU, stepping from the main thread measured 4-5x slower per
    step than from another thread (torch's CPU threading, not HTTP), which would flatter HTTP."""
    result = {}
    thread = threading.Thread(target=lambda: result.update(_closed_loop(engine, prompts, output_len)))
    thread.start()
    thread.join()
    return result


def _closed_loop(engine, prompts, output_len: int) -> dict:
    """A client submits its next request when its last one ends."""
    from runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    queues = [list(p) for p in prompts]
    live, records = {}, []
    start = time.perf_counter()
    for client, q in enumerate(queues):
        live[client] = engine.submit(q.pop(0), params)
    while live:
        engine.step()
        for client, r in list(live.items()):
            if r.finished:
                m = r.metrics
                records.append({"ttft": m.ttft_s, "itl": m.mean_itl_s, "tokens": len(r.output_ids)})
                del live[client]
                if queues[client]:
                    live[client] = engine.submit(queues[client].pop(0), params)
    return summary(records, time.perf_counter() - start)


# ------------------------------------------------------------------------------ over HTTP


async def http_client(client, name: str, prompts, output_len: int, records: list) -> None:
    for prompt in prompts:
        sent = time.perf_counter()
        first = last = None
        tokens = 0
        stream = await client.completions.create(model=name, prompt=prompt, max_tokens=output_len, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                first = first or now
                last = now
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        itl = (last - first) / (tokens - 1) if tokens > 1 and first is not None else None
        records.append({"ttft": first - sent if first else None, "itl": itl, "tokens": tokens})


async def through_http(url: str, prompts, output_len: int) -> dict:
    import openai

    records: list = []
    async with openai.AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, timeout=3600) as client:
        name = (await client.models.list()).data[0].id
        start = time.perf_counter()
        await asyncio.gather(*(http_client(client, name, p, output_len, records) for p in prompts))
        wall = time.perf_counter() - start
    return summary(records, wall)


def start_server(args, max_batch: int) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "lowbit.cli", "serve", args.model, "--port", "0", "--max-batch", str(max_batch),
               "--kv-memory", args.kv_memory] + (["--kv", args.kv] if args.kv else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    banner = ""
    while "auth" not in banner:
        line = proc.stderr.readline()
        if not line:
            raise RuntimeError(f"lowbit serve exited before it listened:\n{banner}")
        banner += line
    port = re.search(r"http://127\.0\.0\.1:(\d+)/v1", banner).group(1)
    # its one log line per request must not fill the pipe and block it
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, f"http://127.0.0.1:{port}/v1"


# ------------------------------------------------------------------------------ main


def ratios(http: dict, local: dict) -> dict:
    def ratio(a, b):
        return a / b if a is not None and b else None

    return {"requests_per_s": ratio(local["requests_per_s"], http["requests_per_s"]),  # > 1: HTTP is slower
            "ttft_p50": ratio(http["ttft_s"].get("p50"), local["ttft_s"].get("p50")),
            "itl_p50": ratio(http["itl_s"].get("p50"), local["itl_s"].get("p50"))}


def run(args) -> dict:
    import runtime
    from evals.provenance import provenance
    from runtime.engine import Engine

    levels = [int(c) for c in args.clients.split(",")]
    model = runtime.load(args.model, device="cuda" if _cuda() else "cpu", kv=args.kv)
    vocab = model.decoder.cfg.vocab_size
    proc, url = start_server(args, max(levels))
    rows = []
    try:
        for clients in levels:
            prompts = prompts_for(clients, args.requests, args.prompt_len, vocab, seed=clients)
            engine = Engine(model, kv_memory=args.kv_memory, max_batch=max(levels))
            in_process(engine, [[p[0]] for p in prompts[:1]], args.output_len)  # warm-up
            local = in_process(engine, prompts, args.output_len)
            engine.shutdown()
            asyncio.run(through_http(url, [[p[0]] for p in prompts[:1]], args.output_len))  # warm-up
            http = asyncio.run(through_http(url, prompts, args.output_len))
            rows.append({"clients": clients, "in_process": local, "http": http, "http_over_in_process": ratios(http, local)})
            print(f"{clients:>3} clients: {http['requests_per_s']:.2f} req/s over HTTP, "
                  f"{local['requests_per_s']:.2f} in-process (x{rows[-1]['http_over_in_process']['requests_per_s']:.3f})",
                  file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    protocol = (f"closed loop: each client sends {args.requests} requests one after another; {args.prompt_len} "
                f"random token ids in, {args.output_len} tokens out (greedy, ignore_eos); HTTP: lowbit serve in its "
                f"own process, the openai client streaming; in-process: runtime.Engine stepped in a thread of its "
                f"own (as the server steps it); "
                f"same max_batch ({max(levels)}) and KV budget ({args.kv_memory}); one warm-up request per side")
    return {"benchmark": "serve", "model": args.model, "kv": model.kv_scheme.name, "protocol": protocol,
            "note": args.note, "levels": rows, **provenance(model.device)}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv", default=None)
    p.add_argument("--kv-memory", default="1GB")
    p.add_argument("--clients", default="1,8,32")
    p.add_argument("--requests", type=int, default=2, help="Requests per client.")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--note", default="", help="Recorded with the results (e.g. that the machine was shared).")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    record = run(args)
    out = args.json
    if out is None:
        slug = re.sub(r"[^a-z0-9]+", "-", record["device"]["name"].lower()).strip("-")
        out = ROOT / "bench" / "results" / "serve" / f"http-overhead-{slug}-{record['commit']}.json"
    write_result(out, record)


if __name__ == "__main__":
    main()
