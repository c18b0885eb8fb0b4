#!/usr/bin/env bash
# Everything in kvtier that needs a CUDA GPU, in one command that ends within 8 minutes on
# an H100/H200 with PyTorch and no vLLM. Results: one JSON and one log.
#
#   scripts/gpu_check.sh [OUT_DIR]     (default: kvtier-out/gpu-check)
#
# Wheels that the GPU machine lacks (blake3, msgspec, redis, hiredis: pip download them for
# its Python) are installed from $KVTIER_WHEELS (default .whl/) into a folder of their own;
# native extensions built for its Python may lie in $KVTIER_WHEELS/native/, used where the
# machine cannot build them. Steps:
#   1. tests/test_cuda.py and tests/test_transfer.py on the GPU;
#   2. mutations: the copier's compute-stream waits, then the compute stream's wait on a
#      load, removed in a copy of the tree: the ordering tests must fail;
#   3. kvtier bench transfer --device cuda --json (the copier against plain copies, and a
#      disk hit through TierWorker and the I/O process against the bytes' own costs);
#   4. compute-sanitizer memcheck over the I/O-process round trips, racecheck over the
#      device -> host -> disk -> host -> device round trip.
# Exit codes: 0 every step passed, 1 a step failed, 3 no CUDA GPU here (nothing run).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-kvtier-out/gpu-check}
mkdir -p "$out"
log="$out/gpu_check.log"
json="$out/gpu_check.json"
: > "$log"
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && python=.venv/bin/python
say() { echo "$*" | tee -a "$log"; }

if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >>"$log" 2>&1; then
  say "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False): nothing run"
  echo '{"gpu": false}' > "$json"
  exit 3
fi

wheels=${KVTIER_WHEELS:-.whl}
if ls "$wheels"/*.whl >/dev/null 2>&1; then
  site=$(mktemp -d /tmp/kvtier-site.XXXX)
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl \
    >>"$log" 2>&1 || { say "gpu_check: installing wheels from $wheels failed"; exit 1; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$python" setup.py -q build_ext --inplace >>"$log" 2>&1; then
  say "gpu_check: native extensions not built here; using $wheels/native"
  cp "$wheels"/native/*.so kvtier/_native/ || { say "gpu_check: no native extensions"; exit 1; }
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

steps=()  # name=rc=seconds
step() {  # step NAME TIMEOUT_S COMMAND...: runs it, logs it, records its exit code and time
  local name=$1 limit=$2; shift 2
  local began=$SECONDS
  say "=== $name: $*"
  timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  steps+=("$name=$rc=$((SECONDS - began))")
  say "=== $name: exit $rc in $((SECONDS - began)) s"
  return $rc
}

"$python" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))" | tee -a "$log"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$log" 2>&1

step tests 240 "$python" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_transfer.py \
  --junitxml="$out/tests.xml"

# Mutations, in a copy of the tree: each must make its ordering tests fail.
mutant=$(mktemp -d /tmp/kvtier-mutant.XXXX)
cp -r kvtier tests setup.py pyproject.toml "$mutant"/
mutate() {  # mutate NAME FILE SED-EXPRESSION TESTS: the tests must fail on the changed copy
  local name=$1 file=$2 expression=$3 tests=$4
  rm -rf "$mutant/kvtier" && cp -r kvtier "$mutant/kvtier"
  sed -i "$expression" "$mutant/$file"
  local changed
  changed=$(diff "$file" "$mutant/$file" | grep -c '^>')
  say "=== mutation $name: $changed line(s) of $file changed by '$expression'"
  (cd "$mutant" && PYTHONPATH="$mutant:${PYTHONPATH#*:}" timeout -k 10 150 "$python" -m pytest -q -p no:cacheprovider \
     tests/test_cuda.py -k "$tests" --junitxml="$out/mutation-$name.xml") >>"$log" 2>&1
  local rc=$?
  # Caught: the tests ran and failed (pytest's exit 1), and the change was made.
  local caught=$(( rc == 1 && changed > 0 ))
  steps+=("mutation_$name=$((1 - caught))=0")
  say "=== mutation $name: pytest exit $rc, $( [ $caught -eq 1 ] && echo caught || echo NOT caught)"
}
# Each ordering line becomes `pass`, keeping its indentation.
mutate compute_stream_waits kvtier/transfer/cuda.py 's|^\( *\).*wait_stream(self._compute_stream).*$|\1pass|' \
  "compute_stream_writes_late or layer_store_waits or does_not_overwrite or worker_layerwise"
mutate load_event_wait kvtier/transfer/cuda.py 's|^\( *\).*compute.wait_event(record.lanes.events\[0\]).*$|\1pass|' \
  "reads_loaded_blocks or worker_layerwise"
mutate step_polls_copies kvtier/worker/tier_worker.py \
  's|if self.device_is_cuda and self.transfers.num_in_flight:|if False:|' "without_its_idle_wait"
rm -rf "$mutant"

began=$SECONDS
say "=== bench: kvtier bench transfer --device cuda --json --repeats 3"
timeout -k 10 240 "$python" -m kvtier.cli bench transfer --device cuda --json --repeats 3 >"$out/bench.json" 2>>"$log"
rc=$?
steps+=("bench=$rc=$((SECONDS - began))")
say "=== bench: exit $rc in $((SECONDS - began)) s"
cat "$out/bench.json" >>"$log"

sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$sanitizer" ]; then
  step memcheck 200 "$sanitizer" --tool memcheck --error-exitcode 9 "$python" -m pytest -q -p no:cacheprovider \
    tests/test_cuda.py -k "round_trip or host_pool_is_shared or killed_mid_load"
  step racecheck 200 "$sanitizer" --tool racecheck --error-exitcode 9 "$python" -m pytest -q -p no:cacheprovider \
    tests/test_cuda.py -k "round_trip and kv_first"
else
  say "gpu_check: compute-sanitizer not found"
  steps+=("memcheck=127=0" "racecheck=127=0")
fi

"$python" - "$json" "$out" "${steps[@]}" <<'EOF'
import json, os, sys, xml.etree.ElementTree as ET
import torch

path, out, steps = sys.argv[1], sys.argv[2], sys.argv[3:]
result = {"gpu": True, "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
          "cuda": torch.version.cuda, "steps": {}}
for entry in steps:
    name, rc, seconds = entry.rsplit("=", 2)
    result["steps"][name] = {"exit": int(rc), "seconds": int(seconds)}
for name in sorted(os.listdir(out)):
    if name.endswith(".xml"):
        root = ET.parse(os.path.join(out, name)).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        result.setdefault("junit", {})[name.removesuffix(".xml")] = {
            k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
bench = os.path.join(out, "bench.json")
try:
    result["bench_transfer_cuda"] = json.load(open(bench))
except (OSError, ValueError):
    pass
result["passed"] = all(s["exit"] == 0 for s in result["steps"].values())
json.dump(result, open(path, "w"), indent=2)
print(json.dumps({k: v for k, v in result.items() if k != "bench_transfer_cuda"}, indent=2))
sys.exit(0 if result["passed"] else 1)
EOF
