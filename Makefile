# Two commands on a fresh machine: `make demo` (install, then run the demo job) and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test lint clean

install: $(STAMP)

# torch is pinned and installed first and on its own: on a CPU machine pip takes the CPU build (never a
# multi-GB CUDA build), on a CUDA machine the default build for the same version.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

demo: $(STAMP)
	$(VENV)/bin/phalanx run examples/demo.yaml

test: $(STAMP)
	$(VENV)/bin/ruff check src tests examples
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
