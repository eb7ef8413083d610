"""bench.vllm_cpu's engine process, lowbit's side (vLLM's needs .venv-vllm: `make vllm-bench`): started
as the bench starts it, it loads the model, answers a batch index with one timed greedy request, and
its tokens are the model's own greedy choices (checked against full forward passes in this process)."""

import os

import torch

import runtime
from bench.vllm_cpu import Worker

OUTPUT_LEN = 5


def test_the_lowbit_worker_answers_each_batch_with_timed_greedy_tokens(model_dir, tmp_path):
    prompts = [[[5, 9, 13, 2, 7, 30, 11, 4]], [[5, 9, 13, 2, 7, 30, 11, 4], [8, 1, 22, 6, 3, 17, 40, 12]]]
    job = {"checkpoint": str(model_dir), "prompts": prompts, "output_len": OUTPUT_LEN, "cores": sorted(os.sched_getaffinity(0))[:1],
           "variant": "float32"}
    worker = Worker("lowbit", job, tmp_path / "worker.log")
    try:
        info = worker.receive()
        replies = [worker.run(i) for i in range(len(prompts))]
    finally:
        worker.close()
    assert info["engine"] == "lowbit" and info["dtype"] == "float32" and info["threads"] == 1
    model = runtime.load(model_dir, dtype=torch.float32)
    for batch, reply in zip(prompts, replies):
        assert reply["ttft_s"] > 0 and len(reply["itls_s"]) == OUTPUT_LEN - 1 and all(t > 0 for t in reply["itls_s"])
        assert len(reply["tokens"]) == len(batch)
        for prompt, tokens in zip(batch, reply["tokens"]):
            logits = model.logits(torch.tensor([prompt + tokens[:-1]]))[0, len(prompt) - 1:]
            assert logits.argmax(-1).tolist() == tokens
