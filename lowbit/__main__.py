"""``python -m lowbit``: the command line, as torchrun starts it (``torchrun ... -m lowbit quantize``)."""

from lowbit.cli import main

main()
