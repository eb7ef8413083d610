"""Perplexity protocol semantics, bundled text, and size accounting."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from evals import size
from evals.perplexity import Protocol, bos_for, hf_logits_fn, perplexity, windows
from evals.texts import load_text
from tiny import tiny_llama, tiny_tokenizer


def context_model(vocab: int):
    """Logits that depend on the whole context: a window change changes the answer."""

    def fn(ids):
        cum = ids[0].cumsum(0).double()
        logits = torch.stack([torch.sin(cum * (v + 1)) for v in range(vocab)], dim=-1)
        return logits.unsqueeze(0)

    return fn


def brute_force_nll(fn, ids, protocol):
    """Score each token once, with the context the protocol promises, one window at a time."""
    total, count = 0.0, 0
    for begin, end, first in windows(len(ids), protocol):
        logp = torch.log_softmax(fn(ids[begin:end].unsqueeze(0))[0], -1)
        for pos in range(first, end):
            total -= float(logp[pos - begin - 1, ids[pos]])
            count += 1
    return total, count


@pytest.mark.parametrize("n, window, stride", [(50, 16, 8), (50, 16, 15), (10, 64, 32), (33, 8, 3), (2, 4, 3)])
def test_every_token_after_the_first_is_scored_once(n, window, stride):
    spans = list(windows(n, Protocol(window=window, stride=stride, tokens=n)))
    scored = [p for _, end, first in spans for p in range(first, end)]
    assert scored == list(range(1, n))
    for begin, end, first in spans:
        assert end - begin <= window and begin <= first - 1
        if begin > 0:
            assert first - begin >= window - stride  # the promised context
    counted = perplexity(lambda x: torch.zeros(1, x.shape[1], 5), torch.zeros(n, dtype=torch.long),
                         Protocol(window=window, stride=stride, tokens=n), progress=False)
    assert counted.tokens_scored == n - 1


def test_reads_only_the_stated_number_of_tokens():
    ids = torch.randint(0, 5, (100,))
    fn = context_model(5)
    cut = perplexity(fn, ids, Protocol(8, 4, tokens=40), progress=False)
    assert cut.tokens_scored == 39
    assert cut.nll == perplexity(fn, ids[:40], Protocol(8, 4, tokens=40), progress=False).nll
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(fn, ids[:1], Protocol(8, 4), progress=False)


def test_matches_brute_force_with_context_dependent_logits():
    ids = torch.randint(0, 7, (61,), generator=torch.Generator().manual_seed(2))
    protocol = Protocol(window=16, stride=6, tokens=61)
    fn = context_model(7)
    result = perplexity(fn, ids, protocol, progress=False)
    total, count = brute_force_nll(fn, ids, protocol)
    assert result.tokens_scored == count == 60
    assert math.isclose(result.nll, total / count, rel_tol=1e-12)


def test_uniform_logits_give_the_vocabulary_size():
    ids = torch.randint(0, 50, (100,))
    result = perplexity(lambda x: torch.zeros(1, x.shape[1], 50), ids, Protocol(16, 8, 100), progress=False)
    assert math.isclose(result.ppl, 50, rel_tol=1e-9)


def test_bos_is_prepended_but_not_scored():
    seen = []

    def fn(x):
        seen.append(x[0, 0].item())
        return torch.zeros(1, x.shape[1], 10)

    result = perplexity(fn, torch.arange(1, 30) % 10, Protocol(8, 4, 29, bos=True), bos_id=9, progress=False)
    assert set(seen) == {9} and result.tokens_scored == 29  # the BOS predicts the first token


def test_disjoint_bos_windows_score_each_token_from_its_own_window_only():
    """stride == window with BOS: every window is BOS + its own tokens, as in llm-compressor's examples."""
    ids = torch.arange(20) % 7
    protocol = Protocol(window=8, stride=8, tokens=20, bos=True)
    model, _ = tiny_llama()
    fn = hf_logits_fn(model)
    total, count = 0.0, 0
    for begin in range(0, 20, 8):  # the same, written out: each chunk scored from BOS alone
        chunk = torch.cat([torch.tensor([5]), ids[begin:begin + 8]])
        logits = fn(chunk.unsqueeze(0))[0, :-1].double()
        total += float(torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum"))
        count += chunk.numel() - 1
    result = perplexity(fn, ids, protocol, bos_id=5, progress=False)
    assert result.tokens_scored == count == 20
    assert math.isclose(result.nll, total / count, rel_tol=1e-6)
    assert "disjoint windows of BOS + 8 tokens" in protocol.describe()


def test_hf_model_agrees_with_its_own_loss():
    model, _ = tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    ours = perplexity(hf_logits_fn(model), ids, Protocol(window=64, stride=32, tokens=40), progress=False)
    with torch.no_grad():
        loss = model(ids.unsqueeze(0), labels=ids.unsqueeze(0)).loss
    assert math.isclose(ours.nll, float(loss), rel_tol=1e-5)


def test_protocol_rejects_nonsense():
    with pytest.raises(ValueError, match="stride"):
        Protocol(window=8, stride=16)
    with pytest.raises(ValueError, match="stride"):
        Protocol(window=8, stride=8)  # without BOS the next window's first token would have no context
    with pytest.raises(ValueError, match="stride"):
        Protocol(window=8, stride=9, bos=True)
    assert "window 1024" in Protocol().describe()


def test_texts(tmp_path):
    assert "Anne Elliot" in load_text("default") and load_text("persuasion") == load_text("default")
    assert "class ArgumentParser" in load_text("code")  # the other genre, bundled too
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n")
    assert load_text(str(tmp_path / "t.jsonl")) == "one\n\ntwo"
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_text(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="no text"):
        load_text(str(tmp_path / "empty.txt"))


def test_weight_stats_count_packed_scales_and_zeros(tmp_path):
    layer = "model.layers.0.mlp.up_proj"
    save_file({
        f"{layer}.weight_packed": torch.zeros(64, 16, dtype=torch.int32),  # 64 x 128 at 4 bits
        f"{layer}.weight_scale": torch.zeros(64, 2, dtype=torch.bfloat16),
        f"{layer}.weight_zero_point": torch.zeros(8, 2, dtype=torch.int32),
        f"{layer}.weight_shape": torch.tensor([64, 128]),
        "model.embed_tokens.weight": torch.zeros(10, 128, dtype=torch.bfloat16),
    }, tmp_path / "model.safetensors")
    s = size.weight_stats(tmp_path)
    assert s.quantized_params == 64 * 128
    assert s.quantized_bytes == 64 * 16 * 4 + 64 * 2 * 2 + 8 * 2 * 4
    assert math.isclose(s.bits_per_weight, 8 * s.quantized_bytes / (64 * 128))
    assert s.other_params == 1280 and s.other_bytes == 2560
    assert math.isclose(s.model_bits_per_param, 8 * (s.quantized_bytes + 2560) / (64 * 128 + 1280))
    assert size.bytes_on_disk(tmp_path) == (tmp_path / "model.safetensors").stat().st_size


def test_weight_stats_of_a_float_model_count_its_linears(tmp_path):
    save_file({"a.weight": torch.zeros(4, 8), "model.embed_tokens.weight": torch.zeros(3, 8, dtype=torch.float16)},
              tmp_path / "model.safetensors")
    s = size.weight_stats(tmp_path)
    assert s.quantized_params == 0 and s.bits_per_weight == 32


def test_bos_modes_follow_the_tokenizer():
    """auto: the BOS when the tokenizer adds one to what it encodes (as the model is used), none
    when it has one but does not add it; on: the BOS whenever there is one; off: never."""
    adds, keeps = tiny_tokenizer(adds_bos=True), tiny_tokenizer()
    assert adds("Anne").input_ids[0] == adds.bos_token_id != keeps("Anne").input_ids[0]
    assert [bos_for(adds, m) for m in ("auto", "on", "off")] == [adds.bos_token_id, adds.bos_token_id, None]
    assert [bos_for(keeps, m) for m in ("auto", "on", "off")] == [None, keeps.bos_token_id, None]
    keeps.bos_token = None
    assert bos_for(keeps, "auto") is None
    with pytest.raises(ValueError, match="has none; use BOS 'off'"):
        bos_for(keeps, "on")
    with pytest.raises(ValueError, match="auto, on, off"):
        bos_for(adds, "yes")
    with pytest.raises(ValueError, match="disjoint windows .* need the BOS"):
        Protocol(window=8, stride=8)

