"""The package as pip installs it from a wheel (not editable): what a user of `pip install lowbit` gets.

The wheel is built from a copy of the sources (the checkout is left untouched) and installed into a fresh
venv that sees this environment's packages through a path file, so nothing is downloaded. A venv made
with --system-site-packages from inside a venv would see the base interpreter's packages, not these.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tiny import save_model, tiny_llama

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["pyproject.toml", "README.md", "quant", "kvquant", "runtime", "evals", "lowbit", "recipes",
           "bench", "lowbit_testing"]  # the last two are in the checkout, not in the wheel
PACKAGE_ROOMS = ["evals", "kvquant", "lowbit", "quant", "runtime"]


def sh(*args, cwd, env=None) -> str:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the installed `lowbit` script, its python, a clean environment, a working directory)."""
    tmp = tmp_path_factory.mktemp("wheel")
    (tmp / "src").mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, tmp / "src" / name, ignore=shutil.ignore_patterns("__pycache__", "results"))
        else:
            shutil.copy(ROOT / name, tmp / "src" / name)
    build_log = sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", tmp / "dist",
                   tmp / "src", cwd=tmp)
    assert "absent from the `packages` configuration" not in build_log, build_log
    venv = tmp / "venv"
    sh(sys.executable, "-m", "venv", venv, cwd=tmp)
    python = venv / "bin" / "python"
    site = sh(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp).strip()
    # this environment's packages, after the venv's own; its editable lowbit is a path file there,
    # which is not read when the directory comes in through a path line, so the wheel's lowbit wins
    Path(site, "test-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    sh(python, "-m", "pip", "install", "--no-deps", "--no-index", *(tmp / "dist").glob("*.whl"), cwd=tmp)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return venv / "bin" / "lowbit", python, env, tmp


def test_the_wheel_installs_the_package_not_the_checkout(installed):
    _, python, env, tmp = installed
    where = sh(python, "-c", "import lowbit, evals, quant; print(lowbit.__file__, evals.__file__, quant.__file__)",
               cwd=tmp, env=env)
    assert str(ROOT) not in where and where.count(str(tmp / "venv")) == 3


def test_the_wheel_ships_the_package_not_the_benches_or_the_test_fixtures(installed):
    _, python, env, tmp = installed
    shipped = sh(python, "-c", "from importlib.metadata import files; "
                 "print(sorted({f.parts[0] for f in files('lowbit') if f.suffix == '.py'}))", cwd=tmp, env=env)
    assert shipped.strip() == str(PACKAGE_ROOMS)


def test_bundled_recipes_and_data_come_with_the_wheel(installed):
    lowbit, python, env, tmp = installed
    assert "w4g64-awq-gptq" in sh(lowbit, "recipes", cwd=tmp, env=env)
    assert "--recipe" in sh(lowbit, "demo", "--help", cwd=tmp, env=env)
    demo_recipe = sh(python, "-c", "from lowbit.recipe_files import find_recipe, load_recipe; "
                     "load_recipe('default'); print(find_recipe('default'))", cwd=tmp, env=env).strip()
    assert demo_recipe.startswith(str(tmp / "venv")) and demo_recipe.endswith("lowbit/recipes/default.yaml")
    sh(python, "-c", "from evals.texts import load_text; from quant.calibration import load_calibration_text; "
       "assert load_text('default') and load_text('code') and load_calibration_text('default')", cwd=tmp, env=env)


def test_a_bundled_recipe_quantizes_by_name(installed):
    lowbit, _, env, tmp = installed
    model_dir = save_model(*tiny_llama(hidden=64), tmp / "tiny")
    out = sh(lowbit, "quantize", "w8-rtn", "--model", model_dir, "--output", tmp / "ckpt", cwd=tmp, env=env)
    assert "w8 per-channel sym" in out and (tmp / "ckpt" / "lowbit_manifest.json").exists()
