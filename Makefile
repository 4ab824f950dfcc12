# dedloc-pipeline: `make test` checks everything; `make install` sets up .venv/.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

BUCKET  ?= file://$(CURDIR)/.dedloc/bucket
RUN     ?= demo
ROUNDS  ?= 10
WORKERS ?= 2
PRESET  ?= tiny
export BUCKET RUN ROUNDS WORKERS PRESET

.PHONY: install test pretrain worker status clean

install: $(STAMP)

# torch is pinned through constraints.txt to the CPU wheel this machine carries; elsewhere the
# same version comes from PyPI.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q -ra tests

# A local collaboration end to end (run, workers, scheduler) on the embedded default bucket.
pretrain: install
	BIN=$(BIN) bash infra/local_collab.sh

# One volunteer worker: make worker BUCKET=s3://bucket/prefix RUN=name
worker: install
	$(BIN)/dedloc worker --bucket "$(BUCKET)" --run "$(RUN)"

status: install
	$(BIN)/dedloc status --bucket "$(BUCKET)" --run "$(RUN)"

clean:
	rm -rf $(VENV) .dedloc .pytest_cache *.egg-info
