"""One engine's process for ``bench.vllm_cpu``: lowbit (in the project's venv) or vLLM (in ``.venv-vllm``),
loaded once and alive for the whole run, answering each command with one timed request.

    python -m bench.vllm_cpu_worker {lowbit,vllm} JOB.json REPLY_FD    # started by bench.vllm_cpu, from the root

JOB: {"checkpoint": path, "prompts": [[[token ids]] per batch size], "output_len": n, "cores": [...],
"variant": lowbit's DTYPE or DTYPE:dense}. Commands are batch indices, one a line on stdin; replies are
JSON lines on the pipe REPLY_FD (stdout is the log): first the engine's facts and load time, then
TTFT, each step's time and the tokens per request. At the top only the standard library is imported
(lowbit is not installed in vLLM's venv; vLLM is not in lowbit's). Run from the repository root with
``-m``, so bench/ is not on ``sys.path`` (its kernels.py would shadow a module vLLM imports).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def pin(cores: list[int]) -> None:
    os.sched_setaffinity(0, set(cores))


class LowbitEngine:
    def __init__(self, job: dict):
        import torch

        import runtime

        torch.set_num_threads(len(job["cores"]))
        dtype, _, path = job["variant"].partition(":")
        self.model = runtime.load(job["checkpoint"], dtype=getattr(torch, dtype) if dtype != "default" else None,
                                  cpu_kernels=False if path == "dense" else None)
        self.info = {"engine": "lowbit", "dtype": str(self.model.dtype).removeprefix("torch."),
                     "variant": job["variant"], "cpu_kernels": path != "dense",
                     "threads": torch.get_num_threads()}

    def request(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[float], list[list[int]]]:
        import torch

        from evals.speed import run_request

        ttft, itls, tokens = run_request(self.model, torch.tensor(prompts), output_len)
        return ttft, itls, tokens.tolist()


class VllmEngine:
    def __init__(self, job: dict):
        import torch
        from vllm import LLM

        largest_batch = max(len(batch) for batch in job["prompts"])
        self.llm = LLM(model=job["checkpoint"], dtype="bfloat16", seed=0, max_num_seqs=largest_batch,
                       max_model_len=len(job["prompts"][0][0]) + job["output_len"] + 8, enable_prefix_caching=False)
        self.info = {"engine": "vllm", "dtype": "bfloat16", "threads": torch.get_num_threads(),
                     "ld_preload": os.environ.get("LD_PRELOAD", "")}

    def request(self, prompts: list[list[int]], output_len: int) -> tuple[float, list[float], list[list[int]]]:
        """Submit the batch and step the engine to the end: TTFT (every sequence's first token), the wall
        time of each step in which every sequence decoded one token (requests reach vLLM's engine core one
        by one, so the first steps may prefill part of the batch while the rest decodes: not counted), the tokens."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
        engine = self.llm.llm_engine
        ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        start = last = time.perf_counter()
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, {"prompt_token_ids": p}, params)
        tokens, ttft, steps = {rid: [] for rid in ids}, None, []
        while engine.has_unfinished_requests():
            before = {rid: len(t) for rid, t in tokens.items()}
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
            if ttft is None and all(tokens.values()):
                ttft = now - start
            elif all(before.values()) and all(len(tokens[rid]) == before[rid] + 1 for rid in ids):
                steps.append(now - last)
            last = now
        return ttft, steps, [tokens[rid] for rid in ids]


def serve(engine_name: str, job: dict, reply) -> None:
    """Load, say so, then answer each command line (a batch index) with one timed request; a batch's
    first command also runs an untimed warm-up."""
    pin(job["cores"])
    start = time.perf_counter()
    engine = (LowbitEngine if engine_name == "lowbit" else VllmEngine)(job)
    send(reply, {**engine.info, "load_s": time.perf_counter() - start})
    warm = set()
    for line in sys.stdin:
        i = int(line)
        prompts = job["prompts"][i]
        if i not in warm:
            engine.request([p[:16] for p in prompts], 2)
            warm.add(i)
        ttft, itls, tokens = engine.request(prompts, job["output_len"])
        send(reply, {"ttft_s": ttft, "itls_s": itls, "tokens": tokens})


def send(reply, message: dict) -> None:
    reply.write(json.dumps(message) + "\n")
    reply.flush()


def main():
    engine, job, reply_fd = sys.argv[1:]
    with os.fdopen(int(reply_fd), "w") as reply:
        serve(engine, json.loads(Path(job).read_text()), reply)


if __name__ == "__main__":
    main()
