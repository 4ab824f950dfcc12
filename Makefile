# dedloc-pipeline: `make test` checks everything (lint, then the whole suite); `make install` sets up .venv/.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

BUCKET  ?= file://$(CURDIR)/.dedloc/bucket
RUN     ?= demo
ROUNDS  ?= 120
WORKERS ?= 2
PRESET  ?= tiny
TARGET  ?= 128
DATA    ?= bengali
SEQ     ?= 64
PREFECT_PORT ?= 4200
export BUCKET RUN ROUNDS WORKERS PRESET TARGET DATA SEQ VOCAB PREFECT_PORT
PREFECT_ENV = PREFECT_HOME=$(CURDIR)/.dedloc/prefect PREFECT_API_URL=http://127.0.0.1:$(PREFECT_PORT)/api

.PHONY: install wheel lock lint browser corpus big-corpus test test-fast bench bench-compare quality pretrain worker eval status server stop clean

install: $(STAMP)

# Every version comes from requirements.lock, so a fresh machine installs the set the tests ran
# with. torch is pinned through constraints.txt to the CPU wheel this machine carries; elsewhere
# the same version comes from PyPI.
PIP_INSTALL = $(BIN)/pip install -q -c constraints.txt -c requirements.lock
$(STAMP): pyproject.toml constraints.txt requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e '.[organizer,test,scale,eval]'
	touch $(STAMP)

# A volunteer's package (its dependencies: the worker's; the organizer's side is the extra
# `organizer`): $(DIST)/dedloc_pipeline-VERSION-py3-none-any.whl, for `pip install` elsewhere.
DIST ?= dist
wheel: | $(STAMP)
	rm -rf "$(DIST)" && $(BIN)/pip wheel -q --no-deps -w "$(DIST)" .

# The embedded Bengali corpus, extracted from registry packages (dedloc_pipeline/model/corpus.py).
CORPUS := .dedloc/corpus
corpus: $(CORPUS)/PROVENANCE.json
$(CORPUS)/PROVENANCE.json: | $(STAMP)
	$(BIN)/python -m dedloc_pipeline.model.corpus $(CORPUS)

# Benchmark 13's corpus: the embedded one's lines recombined, seeded, into CORPUS_GB (default 2) GB of
# gzip text, zstd JSON lines, Parquet and plain text in .dedloc/big-corpus/ (never committed).
CORPUS_GB ?= 2
big-corpus: corpus
	$(BIN)/python -m benchmarks.corpus $(CORPUS_GB)

# Headless chromium renders the report page in the tests: Debian's package, installed if missing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium; }

# The linter (ruff, configured in pyproject.toml): pyflakes, pycodestyle, import order.
lint: install
	$(BIN)/ruff check .

# Two processes (pytest-xdist), a test module at a time (its module-wide servers stay shared), in
# the order tests/conftest.py gives: the long real-part modules first.
PYTEST = $(BIN)/python -m pytest -q -ra --durations=15 -n 2 --dist loadfile --no-loadscope-reorder
test: lint corpus browser
	$(PYTEST) tests

# The fast tier: everything but the cases marked slow (processes, servers, long collaborations).
# test_monitoring's report page is rendered by chromium, so the browser is still needed.
test-fast: install corpus browser
	$(PYTEST) -m "not slow" tests

# Every benchmark in one run (docs/benchmarks.md): tables on screen, numbers in .dedloc/bench/.
BENCH_STAMP := $(VENV)/.bench-stamp
$(BENCH_STAMP): $(STAMP)
	$(PIP_INSTALL) -e '.[test,scale,eval,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks.run

# The same benchmarks for another commit (REF: a release tag by default) beside the working tree,
# one run, with the ratio of every number: make bench-compare [REF=v2026.12.07] [BENCH="aggregation aggregators"].
REF ?= $(shell git describe --tags --abbrev=0 2>/dev/null)
BENCH ?= aggregation
bench-compare: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks.compare $(REF) $(BENCH)

# Refresh the lock from .venv after changing a dependency (to upgrade one package:
# .venv/bin/pip install -c constraints.txt -U NAME, then make lock). It holds the bench extra too (hivemind adds packages and pins none of the others), so
# `make bench` installs a locked set as well. The local label of torch's CPU wheel (+cpu) is
# dropped: PyPI's 2.13.0 satisfies the same line.
lock: $(BENCH_STAMP)
	{ echo "# Every installed version: written by make lock from .venv, read by make install."; \
	  $(BIN)/pip freeze --exclude-editable | sed -E 's/\+[[:alnum:].]+$$//'; } > requirements.lock.tmp
	mv requirements.lock.tmp requirements.lock
	touch $(STAMP) $(BENCH_STAMP)

# Does pretraining pay? A 2-volunteer collaboration next to one process, then fine-tuning (~1 h here).
quality: $(BENCH_STAMP) corpus
	$(BIN)/python -m benchmarks.quality

# A whole collaboration on this machine through the Prefect deployment (infra/local_pretrain.py).
pretrain: install corpus
	$(BIN)/python infra/local_pretrain.py

# One volunteer worker: make worker BUCKET=s3://bucket/prefix RUN=name [PEER=alice KEY=~/.dedloc/alice.pem]
worker: install
	$(BIN)/dedloc worker --bucket "$(BUCKET)" --run "$(RUN)" $(if $(PEER),--peer-id "$(PEER)") $(if $(KEY),--key "$(KEY)")

# The evaluate flow alone (against the local server): make eval RUN=demo [ROUND=5]
eval: install server
	$(PREFECT_ENV) $(BIN)/python -c "from flows.evaluation import evaluate; evaluate('$(BUCKET)', '$(RUN)', $(if $(ROUND),$(ROUND),None))"

status: install
	$(BIN)/dedloc status --bucket "$(BUCKET)" --run "$(RUN)"

server: install
	$(BIN)/python infra/prefect_local.py start --port $(PREFECT_PORT)

stop:
	$(BIN)/python infra/prefect_local.py stop

clean:
	rm -rf $(VENV) .dedloc .pytest_cache *.egg-info
