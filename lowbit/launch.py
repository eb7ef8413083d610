"""Running ``lowbit quantize`` on several ranks: ``--ranks N`` starts torchrun on this machine, and
each rank torchrun starts (``torchrun ... -m lowbit quantize``) joins the process group here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager

import click

from quant import distributed


def as_arguments(options: dict) -> list[str]:
    """Command-line options from their values (flags when True; None and False left out)."""
    args = []
    for flag, value in options.items():
        if value is True:
            args.append(flag)
        elif value not in (None, False):
            args += [flag, str(value)]
    return args


def launch_ranks(ranks: int, args: list[str], device: str | None) -> int:
    """``lowbit quantize ARGS`` on ``ranks`` processes of this machine under torchrun; its exit code."""
    import torch

    if distributed.launched_by_torchrun():
        raise click.UsageError("--ranks launches torchrun; under torchrun leave it out (--nproc-per-node sets the ranks)")
    if (device or "").startswith("cuda") or (device is None and torch.cuda.is_available()):
        if ranks > torch.cuda.device_count():
            raise click.UsageError(f"--ranks {ranks} needs one GPU per rank; this machine has "
                                   f"{torch.cuda.device_count()} (or pass --device cpu)")
    env = dict(os.environ)
    # torchrun gives each rank 1 thread unless told; on CPU the ranks share the cores instead
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "-m", "lowbit", "quantize", *args]
    code = subprocess.run(command, env=env).returncode
    if code != 0:
        click.echo(f"error: the {ranks} ranks stopped (exit {code}); the failing rank's error is above. No checkpoint "
                   "was written; a calibrated run continues with --resume.", err=True)
    return code


@contextmanager
def this_rank(device: str | None):
    """Yield (world, device) for this process: under torchrun, its rank in the process group; else a
    world of one. An error on a rank is recorded for the others and shown with the rank named."""
    world, device = distributed.init_from_env(device)
    if world.size > 1:
        # torchrun stops the other ranks with SIGTERM when one fails: as SystemExit, a save in
        # progress still removes its partial directory on the way out
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        with distributed.use(world):
            yield world, device
    except Exception as e:
        if world.size == 1:
            raise
        raise click.ClickException(world.report_failure(e) + " (no checkpoint was written; a calibrated run "
                                   "continues with --resume)") from None
    finally:
        distributed.close(world)
