"""The benchmarks: each script runs as a module from the repository root, ``python -m bench.<name>``
(``bench/README.md`` lists them and the result file each writes). Nothing in the installed package
imports ``bench``; tests may. ``bench/gpu_check.py`` alone also runs as ``python bench/gpu_check.py``,
the command the lent GPU machine's instructions give."""
