"""The backend chooser (runtime/backend.py): priority order, reasons kept, one list of switches."""

from dataclasses import dataclass

import pytest

from runtime.backend import NoBackend, choose, disabled


@dataclass
class Fake:
    name: str
    refusal: str | None = None
    tags: frozenset = frozenset()

    def refuses(self, case):
        return self.refusal


def test_first_backend_that_runs_is_chosen_with_every_refusal_kept():
    fast, slow, ref = Fake("fast", "needs AMX"), Fake("slow", tags=frozenset({"native"})), Fake("reference")
    choice = choose([fast, slow, ref], case=None, off=())
    assert choice.backend is slow
    assert [(r.name, r.reason) for r in choice.rejected] == [("fast", "needs AMX")]
    assert "fast: needs AMX" in choice.explain()


def test_disabled_by_name_or_group_word():
    slow, ref = Fake("slow", tags=frozenset({"native"})), Fake("reference")
    assert choose([slow, ref], None, off={"native"}).backend is ref
    assert choose([slow, ref], None, off={"slow"}).rejected[0].reason.startswith("disabled")


def test_only_picks_by_name_and_unknown_names_are_refused():
    a, b = Fake("a"), Fake("b")
    assert choose([a, b], None, off=(), only="b").backend is b
    with pytest.raises(ValueError, match="no backend named 'c'"):
        choose([a, b], None, off=(), only="c")
    with pytest.raises(NoBackend, match="a: no"):
        choose([Fake("a", "no")], None, off=())


def test_switches_read_from_one_list_and_the_older_variables():
    assert disabled({"LOWBIT_DISABLE": "cpu-int4, triton"}) == {"cpu-int4", "triton"}
    assert disabled({"LOWBIT_NATIVE": "0", "LOWBIT_CPU_KERNELS": "0"}) == {"native", "cpu"}
    assert disabled({"LOWBIT_NATIVE": "1"}) == frozenset()
