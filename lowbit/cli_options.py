"""What every ``lowbit`` command shares: the OpenMP defaults (set before torch loads), the help texts of
the options several commands take, and the one way user-fixable errors end a command."""

from __future__ import annotations

import os

# OpenMP reads its settings once, when torch loads it: set before anything here imports torch (lowbit's
# __init__ does not), and only where the user has not. A thread waiting for the next parallel region
# spins GOMP_SPINCOUNT=300 pauses (microseconds), then sleeps (PASSIVE): libgomp's default spin
# (300,000, milliseconds) made decode steps many times slower on a busy CPU, the spinning threads taking
# the cores the work needed (bench/cpu_overhead.py); sleeping at once made every one of a decode step's
# ~150 parallel regions wake the other thread through the kernel, which lost the cores to other jobs as
# well: SmolLM2 W4 batch 1 under two busy loops 24 against 84 ms a step (bench/cpu_omp.py,
# bench/results/cpu/NOTES.md). libgomp's spin count overrides its wait policy's, so a user's own wait
# policy or spin count, either one, leaves both unset.
OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "300"}


def openmp_defaults(environ) -> dict:
    """The variables of OPENMP_DEFAULTS to set in ``environ``: none where the user set either."""
    return {} if any(name in environ for name in OPENMP_DEFAULTS) else dict(OPENMP_DEFAULTS)


os.environ.update(openmp_defaults(os.environ))

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
