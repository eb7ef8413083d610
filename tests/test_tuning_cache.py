"""Tuned GEMM winners kept on disk (runtime/kernels/tuning_cache.py) through ``matmul_tuning.tune``,
on CPU with the GPU's timer and launches replaced (test_kernels_tuning's stand-ins): a later process
takes a kept winner after checking it, without timing; a kept winner that fails its check is
discarded and the candidates are timed again; a corrupt file is ignored with a warning and
replaced; the key holds the sources, the shape and the candidates; ``LOWBIT_TUNING_CACHE=0`` turns
it off."""

import json
import warnings

import pytest
import torch

from kernel_device import DEVICE  # noqa: F401 (sets TRITON_INTERPRET before triton is imported)

from runtime.kernels import matmul_tuning as tuning  # noqa: E402
from runtime.kernels import tuning_cache  # noqa: E402
from runtime.tolerances import SELF_CHECK_ENV  # noqa: E402
from test_kernels_tuning import FAST, MIDDLE, SLOW, Candidates, kernel_weight  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache folder (the suite's conftest turns the cache off), nothing known to fail, and
    each warning of the cache warned again in each test."""
    monkeypatch.setenv(tuning_cache.ENV, str(tmp_path / "tuning"))
    monkeypatch.setattr(tuning, "_FAILED", {})
    monkeypatch.setattr(tuning_cache, "_WARNED", set())
    return tmp_path / "tuning"


class Process:
    """One process's tuning of a shape: its timings and checks counted."""

    def __init__(self, monkeypatch, times=None, wrong=frozenset()):
        self.stand_in = Candidates(times or {FAST: 1.0, MIDDLE: 2.0, SLOW: 3.0}, wrong=wrong)
        self.timed, self.checked = 0, []
        real_check = tuning.check

        def time_ms(fn):
            self.timed += 1
            return self.stand_in.time_ms(fn)

        def check(M, kw, dtype, device, config, launch):
            self.checked.append(config)
            real_check(M, kw, dtype, device, config, launch)

        monkeypatch.setattr(tuning, "time_ms", time_ms)
        monkeypatch.setattr(tuning, "check", check)
        monkeypatch.setattr(tuning, "_FAILED", {})  # a new process knows no failure yet

    def tune(self, M=5, kw=None, candidates=None):
        return tuning.tune(M, kw or kernel_weight(), torch.float16, CPU, candidates or list(self.stand_in.times),
                           self.stand_in.launch)


def entries(folder):
    return sorted(folder.glob("*")) if folder.exists() else []


def test_a_later_process_takes_the_kept_winner_after_checking_it(monkeypatch, cache_dir):
    first = Process(monkeypatch)
    assert first.tune() == FAST and first.timed == 3
    [entry] = entries(cache_dir)  # one file, no temporary left
    assert entry.suffix == ".json" and json.loads(entry.read_text())["winner"]["block_m"] == FAST.block_m
    second = Process(monkeypatch, times={FAST: 9.0, MIDDLE: 1.0, SLOW: 2.0})  # its timing would pick MIDDLE
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert second.tune() == FAST
    assert second.timed == 0 and second.checked == [FAST]


def test_the_key_holds_the_shape_the_candidates_and_the_kernel_sources(monkeypatch, cache_dir):
    Process(monkeypatch).tune()
    for change in ({"M": 7}, {"kw": kernel_weight(n=48)}, {"candidates": [SLOW, MIDDLE, FAST]}):
        again = Process(monkeypatch)
        again.tune(**change)
        assert again.timed == 3, change
    monkeypatch.setattr(tuning_cache, "sources_hash", lambda: "a changed kernel")
    again = Process(monkeypatch)
    again.tune()
    assert again.timed == 3 and len(entries(cache_dir)) == 5


def test_a_kept_winner_that_fails_its_check_is_discarded_and_the_candidates_timed(monkeypatch, cache_dir):
    Process(monkeypatch).tune()
    broken = Process(monkeypatch, wrong={FAST})
    with pytest.warns(UserWarning, match="the tuning cache's configuration .* failed its check") as caught:
        assert broken.tune() == MIDDLE
    assert "relative error" in str(caught[0].message) and "timed again" in str(caught[0].message)
    assert broken.timed == 2 and broken.checked == [FAST, MIDDLE]  # the failed one is not timed again
    [entry] = entries(cache_dir)
    assert json.loads(entry.read_text())["winner"]["block_n"] == MIDDLE.block_n


@pytest.mark.parametrize("content", ["{not json", '{"key": {"gpu": "another"}, "winner": {"block_m": 16}}',
                                     "", '{"winner": {"block_m": 16, "block_n": 64, "no_such_field": 1}}'])
def test_a_corrupt_entry_is_ignored_with_a_warning_and_replaced(monkeypatch, cache_dir, content):
    Process(monkeypatch).tune()
    [entry] = entries(cache_dir)
    entry.write_text(content)
    again = Process(monkeypatch)
    with pytest.warns(UserWarning, match="the tuning cache's entry .* is ignored"):
        assert again.tune() == FAST
    assert again.timed == 3 and json.loads(entry.read_text())["winner"]["block_n"] == FAST.block_n


def test_zero_turns_it_off_and_home_is_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(tuning_cache.ENV, "0")
    Process(monkeypatch).tune()
    assert entries(tmp_path / ".cache") == []
    monkeypatch.delenv(tuning_cache.ENV)
    Process(monkeypatch).tune()
    assert len(entries(tmp_path / ".cache" / "lowbit" / "tuning")) == 1


def test_unchecked_winners_are_not_kept(monkeypatch, cache_dir):
    """With the checks switched off the winner is timed, not checked: no later process inherits it."""
    monkeypatch.setenv(SELF_CHECK_ENV, "0")
    Process(monkeypatch).tune()
    assert entries(cache_dir) == []


def test_a_folder_that_cannot_be_written_warns_once_and_tuning_goes_on(monkeypatch, tmp_path):
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv(tuning_cache.ENV, str(blocked))
    with pytest.warns(UserWarning, match="cannot be read or written") as caught:
        assert Process(monkeypatch).tune() == FAST
        assert Process(monkeypatch).tune(M=7) == FAST
    assert len(caught) == 1
