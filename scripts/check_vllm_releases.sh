#!/usr/bin/env bash
# kvtier inside the real scheduler of vLLM releases that serve only on a GPU, with its worker half
# over the KV cache those releases allocate, on the CPU (tests/test_vllm_releases.py). Prints the
# compatibility table's rows from this run.
# Usage: scripts/check_vllm_releases.sh 0.33.0 0.34.0 (after scripts/setup_vllm_releases.sh --wheel-only)
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p kvtier-out
rows=()
status=0
for release in "$@"; do
  env=".venv-vllm-$release"
  found=$("$env/bin/python" -c "from kvtier.integrations.vllm.compat import vllm_release; print(vllm_release())" \
    2>/dev/null | tail -1)
  if [ "$found" != "$release" ]; then
    echo "check: $env runs vLLM $found, not $release"
    exit 1
  fi
  log="kvtier-out/check-vllm-$release.log"
  temp=$(mktemp -d)
  "$env/bin/python" -m pytest -q -p no:cacheprovider --basetemp="$temp/t" -m releases tests/test_vllm_releases.py \
    > "$log" 2>&1
  code=$?
  rm -rf "$temp"
  echo "== scheduler-level check on vllm $release"
  cat "$log"
  result=$(grep -E "(passed|failed|error)" "$log" | tail -1 | sed -E 's/=//g; s/^ +//; s/ in [0-9.]+s.*//')
  rows+=("| vllm $release | scheduler-level: its Scheduler and KV cache allocation, kvtier's both halves | ${result:-no result} |")
  [ "$code" -eq 0 ] || status=1
done
echo
echo "| vLLM release | check | result |"
echo "|---|---|---|"
printf '%s\n' "${rows[@]}"
exit $status
