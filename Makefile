# dedloc-pipeline: `make test` checks everything; `make install` sets up .venv/.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: install test clean

install: $(STAMP)

# torch is pinned through constraints.txt to the CPU wheel this machine carries; elsewhere the
# same version comes from PyPI.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q -ra tests

clean:
	rm -rf $(VENV) .dedloc .pytest_cache *.egg-info
