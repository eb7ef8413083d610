"""Where the command line runs a model, and OpenMP's defaults it sets.

Every subcommand that loads a model picks its device by one rule (``lowbit.pipeline.default_device``):
``--device`` when given, else CUDA when torch sees a GPU, else the CPU. Checked without a GPU: torch's
answer is replaced, and ``runtime.load`` records where it was asked to load, then stops the command.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

import runtime
from lowbit import pipeline
from lowbit.cli import main

COMMANDS = {
    "generate": ["--prompt", "Anne"],
    "speed": [],
    "diagnose": [],
    "eval": ["--no-baseline", "--tokens", "100", "--window", "64", "--stride", "32"],
    "doctor": [],
    "serve": ["--port", "0"],
}


@pytest.fixture
def loads(monkeypatch):
    """The devices ``runtime.load`` is asked for (each call then fails, ending the command)."""
    devices = []

    def load(path, device="cpu", **kwargs):
        devices.append(str(device))
        raise ValueError("stopped by the test once the device is chosen")

    monkeypatch.setattr(runtime, "load", load)
    return devices


def gpu_visible(monkeypatch, visible: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible)


@pytest.mark.parametrize("visible, flag, expected", [(True, None, "cuda"), (False, None, "cpu"), (True, "cpu", "cpu")])
def test_default_device_prefers_a_visible_gpu_and_obeys_the_flag(monkeypatch, visible, flag, expected):
    gpu_visible(monkeypatch, visible)
    assert pipeline.default_device(flag) == expected


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("visible, flag, expected", [(True, None, "cuda"), (True, "cpu", "cpu"), (False, None, "cpu")])
def test_every_subcommand_loads_where_the_rule_says(monkeypatch, loads, model_dir, command, visible, flag, expected):
    gpu_visible(monkeypatch, visible)
    args = [command, str(model_dir), *COMMANDS[command], *(["--device", flag] if flag else [])]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1 and "stopped by the test" in result.output, result.output
    assert loads == [expected]


@pytest.mark.parametrize("flag, says", [("cuda", "sees no CUDA GPU"), ("gpu0", "not a device torch knows")])
def test_a_device_that_cannot_run_is_one_line_before_anything_loads(monkeypatch, loads, model_dir, flag, says):
    gpu_visible(monkeypatch, False)
    for command in COMMANDS:
        result = CliRunner().invoke(main, [command, str(model_dir), *COMMANDS[command], "--device", flag])
        assert result.exit_code == 1 and says in result.output and "Traceback" not in result.output, result.output
    assert loads == []


@pytest.mark.parametrize("users, expected", [
    ({}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "300"}),  # lowbit's: a short spin, then sleep
    ({"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}),  # no spin at all
    ({"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "0"}),
])
def test_the_cli_sets_openmp_waiting_unless_the_user_did(users, expected):
    # OpenMP reads these when torch loads it: importing lowbit must not import torch first; a user's own
    # wait policy or spin count leaves the other unset too (libgomp's spin count overrides the policy's)
    env = {k: v for k, v in os.environ.items() if k not in expected} | users
    code = ("import json, os, sys, lowbit; before = 'torch' in sys.modules; import lowbit.cli; "
            f"print(json.dumps([before, 'torch' in sys.modules, {{k: os.environ.get(k) for k in {list(expected)}}}]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [False, True, expected]
