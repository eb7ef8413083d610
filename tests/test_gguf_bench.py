"""bench/gguf_vs_llamacpp reads llama-perplexity's two reports right (the float file's, saving its
logits, and a quantized file's against them, in the format of llama.cpp's tools/perplexity), and
takes a lowbit file made by an earlier run only when it was made the same way."""

import json

import pytest

from bench import gguf_vs_llamacpp as bench

FLOAT_REPORT = "[1]7.1,[2]6.9,\nFinal estimate: PPL = 6.6135 +/- 0.35772\n"
KL_REPORT = """====== Perplexity statistics ======
Mean PPL(Q)                   :   7.817500 ±   0.424810
Mean PPL(base)                :   6.613500 ±   0.357720
Cor(ln(PPL(Q)), ln(PPL(base))):  98.12%
Mean ln(PPL(Q)/PPL(base))     :   0.167231 ±   0.006020
Mean PPL(Q)/PPL(base)         :   1.182007 ±   0.007115

====== KL divergence statistics ======
Mean    KLD:   0.151234 ±   0.002345
Maximum KLD:   7.123456
====== Token probability statistics ======
Same top p:  85.123 ±  0.313 %
"""


@pytest.fixture
def tool(monkeypatch, tmp_path):
    calls = []

    def run_tool(bin_dir, name, *args, log):
        calls.append(args)
        return FLOAT_REPORT if "--kl-divergence" not in args else KL_REPORT

    monkeypatch.setattr(bench, "run_tool", run_tool)
    monkeypatch.setattr(bench, "file_facts", lambda model: {"bpw": 5.0})
    return calls


def test_float_run_saves_logits_and_quantized_runs_score_against_them(tool, tmp_path):
    base = tmp_path / "float.kld"
    row = bench.perplexity(tmp_path, tmp_path / "f32.gguf", tmp_path / "t.txt", 512, 2, tmp_path / "log", base)
    assert row == {"ppl": 6.6135, "ppl_err": 0.35772, "bpw": 5.0}
    assert "--kl-divergence" not in tool[0] and base in tool[0]
    base.write_bytes(b"saved")
    row = bench.perplexity(tmp_path, tmp_path / "q.gguf", tmp_path / "t.txt", 512, 2, tmp_path / "log", base)
    assert row == {"ppl": 7.8175, "ppl_err": 0.42481, "ln_ppl_ratio": 0.167231, "ln_ppl_ratio_err": 0.00602,
                   "kld": 0.151234, "kld_err": 0.002345, "same_top_token_pct": 85.123,
                   "same_top_token_pct_err": 0.313, "bpw": 5.0}


def test_a_report_without_the_statistics_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "run_tool", lambda *a, log: "llama.cpp said nothing useful")
    (tmp_path / "float.kld").write_bytes(b"saved")
    with pytest.raises(RuntimeError, match="no ppl"):
        bench.perplexity(tmp_path, tmp_path / "q.gguf", tmp_path / "t.txt", 512, 2, tmp_path / "log",
                         tmp_path / "float.kld")


def test_a_kept_lowbit_file_is_taken_only_when_made_the_same_way(tmp_path):
    out = tmp_path / "lowbit-Q2_K.gguf"
    made_with = {"methods": ["gptq"], "gptq": {}, "samples": 16, "quant_source": "abc"}
    assert bench.made_before(out, made_with) is None
    out.write_bytes(b"gguf")
    out.with_suffix(".json").write_text(json.dumps({"made_with": made_with, "facts": {"quantize_cpu_s": 1.0}}))
    assert bench.made_before(out, made_with) == {"quantize_cpu_s": 1.0, "made_by_earlier_run": True}
    assert bench.made_before(out, {**made_with, "samples": 64}) is None
