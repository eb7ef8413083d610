"""The lowbit command line run in this process, as the command-line tests drive it."""

from click.testing import CliRunner

from lowbit.cli import main


def run(*args):
    """``lowbit ARGS``, each argument as a string; an exception inside a command propagates, so a
    traceback fails the test instead of passing as a nonzero exit (``tests/test_trust.py`` has the
    variant that asserts no traceback reaches the user)."""
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
