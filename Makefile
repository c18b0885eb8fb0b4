# The two set-up commands: `make demo` and `make test`. Each creates .venv on first use.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvtier-ready

.PHONY: setup demo test test-fast bench clean

$(STAMP): pyproject.toml setup.py scripts/setup_env.sh kvtier/_native/copy_runs.c
	bash scripts/setup_env.sh
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m kvtier.cli demo

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not vllm"

bench: $(STAMP)
	$(PY) -m kvtier.cli bench transfer
	$(PY) -m kvtier.cli bench ttft

clean:
	rm -rf $(VENV) build *.egg-info kvtier/_native/*.so
