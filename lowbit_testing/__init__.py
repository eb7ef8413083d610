"""What the tests and the benches share and users never need: tiny random models built in code
(``tiny_models``) and the counts of what a piece of code asks of the device (``counting``).

Not part of the installed package (``pyproject.toml`` lists the packages it ships): importable from
the repository root, where the tests run (pytest's ``pythonpath``) and the benches run
(``python -m bench.<name>``). It may import the package's rooms; nothing in them imports it.
"""
