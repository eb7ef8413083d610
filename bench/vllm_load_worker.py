"""Runs in .venv-vllm (vLLM's CPU build), for bench/vllm_interop.py and tests/test_vllm.py: loads each checkpoint of a job in vLLM
one after another in this one process, and for each writes what vLLM made of it: the error that refused
it, or its greedy tokens and the log-probabilities of the prompt tokens (``prompt_logprobs``).

    python bench/vllm_load_worker.py JOB.json RESULT.json

JOB: {"checkpoints": {label: path}, "prompts": [[token ids]], "new_tokens": n, "max_model_len": n}.
Imports only vLLM and the standard library (lowbit is not installed in that venv).
"""

import gc
import json
import sys
import time
import traceback


def run_one(path: str, job: dict) -> dict:
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    try:
        llm = LLM(model=path, dtype="bfloat16", seed=0, max_model_len=job["max_model_len"],
                  max_num_seqs=len(job["prompts"]), enforce_eager=True, enable_prefix_caching=False)
    except Exception as e:  # a refusal: keep its message (the last lines name the reason)
        return {"loaded": False, "error": "".join(traceback.format_exception_only(type(e), e))[-2000:], "load_s": time.perf_counter() - start}
    load_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=job["new_tokens"], ignore_eos=True, prompt_logprobs=0,
                            detokenize=False)
    try:  # some refusals come only at the first step (an attention head size its kernels lack)
        outputs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
    except Exception as e:
        del llm
        gc.collect()
        return {"loaded": False, "error": "".join(traceback.format_exception_only(type(e), e))[-2000:],
                "load_s": load_s, "failed_at": "generate"}
    result = {"loaded": True, "load_s": load_s, "tokens": [], "prompt_logprobs": []}
    for prompt, out in zip(job["prompts"], outputs):
        result["tokens"].append(list(out.outputs[0].token_ids))
        # position 0 has none; each later entry holds the prompt token's own log-probability
        result["prompt_logprobs"].append([entry[token].logprob for token, entry in zip(prompt[1:], out.prompt_logprobs[1:])])
    del llm
    gc.collect()
    return result


def main():
    job = json.load(open(sys.argv[1]))
    import vllm

    results = {"vllm": vllm.__version__, "checkpoints": {}}
    for label, path in job["checkpoints"].items():
        results["checkpoints"][label] = run_one(path, job)
        print(label, {k: v for k, v in results["checkpoints"][label].items() if k in ("loaded", "load_s")}, flush=True)
    json.dump(results, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
