"""The lm-eval model type and the offline tasks, on a tiny random model: scores equal the runtime's own."""

import json
import sys

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from evals import lm_eval_tasks  # noqa: E402
from evals.lm_eval_adapter import LowbitLM, run_tasks  # noqa: E402
from lowbit.cli import main  # noqa: E402
from tiny import TEXT  # noqa: E402

PAIRS = [("Anne Elliot walked", " along the shore at Lyme"), ("It is a truth universally", " acknowledged"),
         ("A single man in possession of a good fortune, must be in want", " of a wife."), ("", "Anne")]


def request(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


@pytest.fixture(scope="module")
def lm(model_dir):
    return LowbitLM(pretrained=str(model_dir), batch_size=1)


def expected_loglikelihood(lm, context, continuation):
    ctx = lm.tok_encode(context) if context else [lm.prefix_token_id]
    whole = lm.tok_encode(context + continuation)
    cont = whole[len(ctx):] if context else lm.tok_encode(continuation)
    ids = (ctx + cont)[:-1]
    logprobs = F.log_softmax(lm.model.logits(torch.tensor([ids]))[0].double(), -1)[-len(cont):]
    return float(logprobs.gather(1, torch.tensor(cont)[:, None]).sum()), bool((logprobs.argmax(-1) == torch.tensor(cont)).all())


def test_loglikelihood_is_the_runtimes_log_probability(lm):
    got = lm.loglikelihood([request("loglikelihood", c, x) for c, x in PAIRS], disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(PAIRS, got):
        want, want_greedy = expected_loglikelihood(lm, context, continuation)
        assert logprob == pytest.approx(want, abs=1e-4) and greedy == want_greedy
        assert logprob < 0


def test_batching_does_not_change_scores(model_dir, lm):
    batched = LowbitLM(pretrained=str(model_dir), batch_size=4, model=lm.model)
    reqs = [request("loglikelihood", c, x) for c, x in PAIRS]
    one = lm.loglikelihood(reqs, disable_tqdm=True)
    many = batched.loglikelihood(reqs, disable_tqdm=True)
    assert [s for s, _ in many] == pytest.approx([s for s, _ in one], abs=1e-4)


def test_quantized_kv_scores_through_the_cache(model_dir, lm):
    """An unquantized cache through the chunked path gives the plain scores; int8 moves them a little."""
    long_ctx = TEXT[:300]
    reqs = [request("loglikelihood", long_ctx, " Anne Elliot walked along the shore")]
    plain = lm.loglikelihood(reqs, disable_tqdm=True)[0][0]
    via_cache = LowbitLM(pretrained=str(model_dir), kv="fp16-r16", kv_chunk=3)
    assert via_cache.kv.name == "fp16"
    assert via_cache._score_cached(*_pair(via_cache, reqs[0]))[0] == pytest.approx(plain, abs=1e-4)
    int8 = LowbitLM(pretrained=str(model_dir), kv="int8-r16", kv_chunk=3)
    quantized = int8.loglikelihood(reqs, disable_tqdm=True)[0][0]
    assert quantized != plain and quantized == pytest.approx(plain, rel=0.05)


def _pair(lm, req):
    ctx, cont = lm._encode_pair(*req.args)
    ids, n = lm._window(ctx, cont)
    return ids, cont[-n:]


def test_rolling_loglikelihood_scores_every_token_once(model_dir, lm):
    text = TEXT[:200]
    tokens = lm.tok_encode(text, add_special_tokens=False)
    whole = lm.loglikelihood_rolling([request("loglikelihood_rolling", text)], disable_tqdm=True)[0]
    want, _ = expected_loglikelihood(lm, "", text)  # one window: the prefix token, then every token
    assert whole == pytest.approx(want, abs=1e-3)
    short = LowbitLM(pretrained=str(model_dir), max_length=8, model=lm.model)
    scored = []
    original = short._loglikelihood_tokens
    short._loglikelihood_tokens = lambda reqs, **kw: (scored.extend(t for _, _, c in reqs for t in c), original(reqs, **kw))[1]
    short.loglikelihood_rolling([request("loglikelihood_rolling", text)], disable_tqdm=True)
    assert scored == tokens and len(tokens) > 8


def test_generate_until_is_greedy_decoding_cut_at_the_stop_strings(lm):
    context = "Anne Elliot walked along"
    ids = lm.tok_encode(context)
    gen = lm.model.generate(ids, max_new_tokens=10)
    list(gen)
    free = lm.generate_until([request("generate_until", context, {"until": [], "max_gen_toks": 10})], disable_tqdm=True)
    assert free == [gen.text] and gen.text
    stop = gen.text[len(gen.text) // 2:][:2]
    cut = lm.generate_until([request("generate_until", context, {"until": [stop], "max_gen_toks": 10})],
                            disable_tqdm=True)[0]
    assert cut == gen.text.split(stop)[0]


def test_offline_tasks_are_built_from_the_bundled_text():
    docs = lm_eval_tasks.offline_docs()
    assert docs == lm_eval_tasks.offline_docs()  # deterministic: the same tasks on every machine
    assert len(docs["lowbit_persuasion_ppl"]) == 24 and len(docs["lowbit_persuasion_cloze"]) == 40
    for d in docs["lowbit_persuasion_cloze"]:
        assert len(d["choices"]) == 4 and len(set(d["choices"])) == 4 and 0 <= d["label"] < 4
    assert all(len(d["answer"].split()) == 2 for d in docs["lowbit_persuasion_gen"])


def test_offline_group_runs_all_three_request_types(model_dir):
    out = run_tasks(str(model_dir), [lm_eval_tasks.OFFLINE_GROUP], limit=2)
    tasks = out["tasks"]
    assert 0 <= tasks["lowbit_persuasion_cloze"]["acc,none"] <= 1
    assert tasks["lowbit_persuasion_ppl"]["bits_per_byte,none"] > 0
    assert 0 <= tasks["lowbit_persuasion_gen"]["exact_match,strip"] <= 1
    assert out["settings"]["kv"] == "fp16" and out["n_samples"]["lowbit_persuasion_ppl"] == 2


def test_unknown_task_lists_close_matches(model_dir):
    with pytest.raises(lm_eval_tasks.TaskError, match="close matches: lowbit_persuasion_cloze"):
        run_tasks(str(model_dir), ["lowbit_persuasion_cloz"])
    result = CliRunner().invoke(main, ["eval", str(model_dir), "--no-baseline", "--tasks", "helaswag"])
    assert result.exit_code != 0 and "hellaswag" in result.output


def test_hub_dataset_offline_names_the_offline_alternative(model_dir, monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    # offline mode on: the same answer whether or not this machine could reach the hub
    with pytest.raises(lm_eval_tasks.TaskError, match="OfflineModeIsEnabled.*unreachable.*lowbit_offline"):
        lm_eval_tasks.prepare_tasks(["arc_easy"])


def test_eval_command_writes_task_metrics_into_the_run(model_dir, tmp_path):
    out = tmp_path / "run.json"
    result = CliRunner().invoke(main, ["eval", str(model_dir), "--no-baseline", "--tokens", "200", "--window", "64",
                                       "--stride", "32", "--tasks", "lowbit_persuasion_cloze", "--limit", "3",
                                       "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    run = json.loads(out.read_text())
    assert 0 <= run["tasks"]["tasks"]["lowbit_persuasion_cloze"]["acc,none"] <= 1
    assert run["tasks"]["settings"]["lm_eval"]
    assert "| lowbit_persuasion_cloze | acc |" in result.output


def test_lm_eval_command_line_runs_the_lowbit_model(model_dir, monkeypatch, capsys):
    """`lowbit-lm-eval --model lowbit --model_args pretrained=...,kv=int8`: lm-eval's own CLI."""
    from evals.lm_eval_adapter import main as lm_eval_main

    monkeypatch.setattr(sys, "argv", ["lowbit-lm-eval", "--model", "lowbit", "--model_args",
                                      f"pretrained={model_dir},kv=int8", "--tasks", "lowbit_persuasion_cloze",
                                      "--limit", "2", "--device", "cpu"])
    lm_eval_main()
    out = capsys.readouterr().out
    assert "lowbit_persuasion_cloze" in out and "acc" in out


def test_a_mistyped_model_argument_is_not_silently_dropped(model_dir, lm):
    with pytest.warns(UserWarning, match="ignores kv_chunck"):
        LowbitLM(pretrained=str(model_dir), model=lm.model, kv_chunck=3)
