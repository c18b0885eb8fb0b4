# The two set-up commands: `make demo` and `make test`. Each creates .venv on first use.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvtier-ready
# Other vLLM releases that CI runs an end-to-end smoke test on; the whole suite runs on .venv's.
RELEASES := 0.30.0 0.31.0
# Releases that serve only on a GPU: kvtier runs inside their real scheduler, over the KV cache they allocate.
SCHEDULER_RELEASES := 0.33.0 0.34.0

.PHONY: setup demo test test-fast bench clean

$(STAMP): pyproject.toml setup.py scripts/setup_env.sh $(wildcard kvtier/_native/*.c) third_party/xxhash/xxhash.h
	bash scripts/setup_env.sh
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m kvtier.cli demo

# The smoke runs' environments are installed while the suite runs. The suite runs in two parts, each
# on two workers: the tests without an engine first (some time what kvtier does, so no engine runs
# beside them), then the engine tests, a test file each at a time (an engine run is mostly one busy
# thread and waits: start-up imports, vLLM's shutdown). Each test's time is kept in kvtier-out/*.xml.
# The scheduler-level checks (one process each, no model) run beside the two releases' smoke runs.
test: $(STAMP)
	@mkdir -p kvtier-out
	@(bash scripts/setup_vllm_releases.sh $(RELEASES) && bash scripts/setup_vllm_releases.sh --wheel-only \
	  $(SCHEDULER_RELEASES)) > kvtier-out/releases-setup.log 2>&1 & setup=$$!; \
	$(PY) -m pytest -q -p no:cacheprovider --durations=10 --junitxml=kvtier-out/tests.xml \
	  -m "not vllm and not releases" -n 2; code=$$?; \
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 --junitxml=kvtier-out/engine-tests.xml \
	  -m vllm -n 2 --dist loadfile --no-loadscope-reorder; engines=$$?; \
	[ $$code -ne 0 ] || code=$$engines; \
	wait $$setup; setup_code=$$?; cat kvtier-out/releases-setup.log; \
	[ $$code -eq 0 ] || exit $$code; [ $$setup_code -eq 0 ] || exit $$setup_code; \
	bash scripts/check_vllm_releases.sh $(SCHEDULER_RELEASES) > kvtier-out/checks.log 2>&1 & checks=$$!; \
	bash scripts/smoke_vllm_releases.sh $(RELEASES); smoke=$$?; \
	wait $$checks; checks=$$?; cat kvtier-out/checks.log; [ $$smoke -eq 0 ] && exit $$checks; exit $$smoke

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not vllm and not releases"

bench: $(STAMP)
	$(PY) -m kvtier.cli bench transfer
	$(PY) -m kvtier.cli bench ttft

clean:
	rm -rf $(VENV) $(VENV)-vllm-* build *.egg-info kvtier/_native/*.so
