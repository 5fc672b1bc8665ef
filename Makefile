# Every target wraps the `omnijev` command line; `make test` builds its own virtual environment.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OMNIJEV := $(VENV)/bin/omnijev
# one artifact layout: `make demo` writes these, and parity, bench and serve read them
CHECKPOINT ?= artifacts/demo/checkpoint
ENGINES ?= artifacts/demo/engines
FUZZ_ARGS ?= --seed 0 --requests 10000
HOST ?= 127.0.0.1
PORT ?= 8000
# pytest-xdist processes for `make test`, each test module in one of them (the CI machine's cores)
TEST_WORKERS ?= 2

.PHONY: venv test lint demo serve checkpoint engines parity bench profile fuzz clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@echo "installing the dependencies (about a minute; pip shows each package)"
	$(VENV)/bin/pip install --progress-bar on --upgrade pip
	$(VENV)/bin/pip install --progress-bar on -e '.[reference,tensorrt-rtx,dev]'
	touch $@

venv: $(VENV)/.installed

test: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m pytest -q -m "not slow and not gpu" -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

checkpoint: venv
	$(OMNIJEV) checkpoint --preset tiny --seed 0 --out $(CHECKPOINT)

engines: venv
	$(OMNIJEV) engines --checkpoint $(CHECKPOINT) --out $(ENGINES)

# the seeded abuse run of issue 14 against a real worker on 127.0.0.1 (minutes; not in `make test`),
# its malformed bodies sent to the three decision routes, then schemathesis against the same worker:
# `st run --checks all http://127.0.0.1:PORT/openapi.json` (settings: schemathesis.toml)
fuzz: venv
	$(PY) -m tools.fuzz $(FUZZ_ARGS)

demo: venv
	$(OMNIJEV) demo --host $(HOST) --port $(PORT)

serve: venv
	$(OMNIJEV) serve --checkpoint $(CHECKPOINT) --engines $(ENGINES) --host $(HOST) --port $(PORT)

parity: venv
	$(OMNIJEV) parity --checkpoint $(CHECKPOINT) --engines $(ENGINES)

bench: venv
	$(OMNIJEV) bench --checkpoint $(CHECKPOINT) --engines $(ENGINES) $(BENCH_ARGS)

# the per-stage profile of every workload, with the reference beside (needs a GPU to mean much)
profile: venv
	$(OMNIJEV) bench --checkpoint $(CHECKPOINT) --engines $(ENGINES) --runs 5 --clients 0 \
		--reference-dtype bfloat16 --out artifacts/profile.json

clean:
	rm -rf artifacts .pytest_cache
