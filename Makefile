# `make run` and `make test` do all their own set-up on a fresh machine: they create .venv
# with Python >= 3.12 (python3.12/3.13 on PATH, or pyenv's) and install jequi into it.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench-cpu
run: $(STAMP)
	$(PY) -m jequi

# Tests run in parallel processes (pytest-xdist): interpret-mode kernels are CPU-bound.
test: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses 4

bench-cpu: $(STAMP)
	$(PY) benchmarks/cpu_reference.py

$(STAMP): pyproject.toml
	@set -e; py=""; \
	for cand in python3.13 python3.12 python3 python; do \
	  if command -v $$cand >/dev/null 2>&1 && $$cand -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then py=$$cand; break; fi; \
	done; \
	if [ -z "$$py" ] && command -v pyenv >/dev/null 2>&1; then \
	  v=$$(pyenv versions --bare | grep -E '^3\.(1[2-9])' | sort -V | tail -n 1); \
	  [ -n "$$v" ] && py="$$(pyenv root)/versions/$$v/bin/python"; \
	fi; \
	[ -n "$$py" ] || { echo "jequi needs Python >= 3.12 (JAX >= 0.11 does)"; exit 1; }; \
	echo "using $$py ($$($$py -V))"; \
	$$py -m venv $(VENV); \
	$(PY) -m pip install -q --upgrade pip; \
	$(PY) -m pip install -q -e ".[test]"
	# Nequix (the oracle of tests/test_nequix.py) pins jax[cuda12]: installed without its dependencies
	$(PY) -m pip install -q --no-deps "nequix==0.4.5"
	touch $(STAMP)
