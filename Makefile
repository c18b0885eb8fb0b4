# The two set-up commands: `make demo` and `make test`. Each creates .venv on first use.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvtier-ready
# Other vLLM releases that CI runs an end-to-end smoke test on; the whole suite runs on .venv's.
RELEASES := 0.30.0 0.31.0

.PHONY: setup demo test test-fast bench clean

$(STAMP): pyproject.toml setup.py scripts/setup_env.sh $(wildcard kvtier/_native/*.c) third_party/xxhash/xxhash.h
	bash scripts/setup_env.sh
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m kvtier.cli demo

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --durations=15
	bash scripts/setup_vllm_releases.sh $(RELEASES)
	bash scripts/smoke_vllm_releases.sh $(RELEASES)

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not vllm"

bench: $(STAMP)
	$(PY) -m kvtier.cli bench transfer
	$(PY) -m kvtier.cli bench ttft

clean:
	rm -rf $(VENV) $(VENV)-vllm-* build *.egg-info kvtier/_native/*.so
