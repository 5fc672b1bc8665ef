# Every target wraps the `omnijev` command line; `make test` builds its own virtual environment.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
OMNIJEV := $(VENV)/bin/omnijev
CHECKPOINT ?= artifacts/tiny
ENGINES ?= artifacts/tiny-engines
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: venv test lint demo serve checkpoint engines parity bench profile clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[reference,tensorrt-rtx,dev]'
	touch $@

venv: $(VENV)/.installed

test: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m pytest -q -m "not slow and not gpu" $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

checkpoint: venv
	$(OMNIJEV) checkpoint --preset tiny --seed 0 --out $(CHECKPOINT)

engines: venv
	$(OMNIJEV) engines --checkpoint $(CHECKPOINT) --out $(ENGINES)

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
	$(OMNIJEV) bench --checkpoint $(CHECKPOINT) --engines $(ENGINES) --runs 5 \
		--reference-dtype bfloat16 --out artifacts/profile.json

clean:
	rm -rf artifacts .pytest_cache
