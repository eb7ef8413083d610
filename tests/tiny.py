"""The tiny random models the tests build: their home is ``lowbit_testing/tiny_models.py`` (the
benches use them too); re-exported here for the test modules' ``from tiny import ...``."""

from lowbit_testing.tiny_models import TEXT, save_model, tiny_llama, tiny_model, tiny_tokenizer  # noqa: F401
