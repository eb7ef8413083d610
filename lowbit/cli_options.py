"""What every ``lowbit`` command shares: the OpenMP defaults (set before torch loads), the help texts of
the options several commands take, and the one way user-fixable errors end a command."""

from __future__ import annotations

import os

# OpenMP reads its settings once, when torch loads it: set before anything here imports torch (lowbit's
# __init__ does not), and only where the user has not. PASSIVE: a thread waiting for the next parallel
# region sleeps rather than spins; on a busy CPU the spinning threads took the cores the work needed
# (bench/cpu_overhead.py: decode steps many times slower with 2 spinning threads than with 1).
OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
for _name, _value in OPENMP_DEFAULTS.items():
    os.environ.setdefault(_name, _value)

import sys  # noqa: E402

import click  # noqa: E402

from kvquant import schemes as kv_families  # noqa: E402

DEVICE_HELP = "Where to run it: cpu, cuda or cuda:N (default: cuda if torch sees a GPU, else cpu)."
# Every --kv option names the schemes the KV-cache families list (kvquant/schemes/, one file each).
KV_HELP = (f"KV-cache scheme: {kv_families.names_text()}, optionally with -g<group_size> and -r<residual> "
           "(int4-g64-r128); default: the checkpoint's.")


def fail_cleanly(fn):
    """Turn the errors a user can fix into one clear line and a non-zero exit."""
    import functools

    from lowbit.recipe import RecipeError
    from quant.checkpoint import CheckpointError
    from quant.plan import PlanError

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        import runtime

        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            click.echo("interrupted: no checkpoint was written (a calibrated run can continue with --resume)", err=True)
            sys.exit(130)
        except (RecipeError, CheckpointError, PlanError, runtime.UnsupportedModelError,
                OSError, ValueError) as e:  # OSError: unreadable files (FileNotFoundError, a bad config, ...)
            raise click.ClickException(str(e)) from None

    return wrapper
