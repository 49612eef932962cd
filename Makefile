# Two commands on a fresh machine: `make demo` (install, then run the demo job) and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

BENCH  ?= .venv-bench

.PHONY: install demo test docs bench bench-env clean

install: $(STAMP)

# torch is pinned and installed first and on its own: on a CPU machine pip takes the CPU build (never a
# multi-GB CUDA build), on a CUDA machine the default build for the same version.
# bench/gpu.sh's wheels, for this interpreter, go beside it: its CPU dry run (a test) reaches no registry.
$(STAMP): pyproject.toml bench/gpu-wheels.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	PY=$(PY) bash bench/gpu_wheels.sh $(VENV)/gpu-wheels --here
	touch $@

demo: $(STAMP)
	$(VENV)/bin/phalanx run examples/demo.yaml

test: $(STAMP)
	$(VENV)/bin/ruff check src tests examples bench
	$(PY) -m pytest -q

# The job spec reference is generated from the pydantic models; a test fails when it is stale.
docs: $(STAMP)
	$(PY) -m phalanx.spec.reference > docs/spec.md

# Every benchmark, each against its peer in the same run; writes bench/RESULTS.md (bench/run.py).
bench: $(STAMP) $(BENCH)/.installed
	$(PY) bench/run.py

# The peers' environment. mosaicml-streaming imports torchvision, and the torchvision this machine can install
# pairs with torch 2.14.1 (a CUDA build, several GB), so it stays out of .venv. torchft 0.2.0 needs a newer torch
# than .venv's too. torchtitan is 0.2.2, the release the lent GPU machine's torch 2.11 runs (bench/gpu.sh), so
# that both places run the same peer. phalanx goes in without its dependencies (it pins torch < 2.14).
# bench/control_plane.py drives the server with wrk and starts a PostgreSQL: both from Debian's packages.
# bench/data_loader.py's remote section reads from moto's S3 server: s3fs for phalanx, boto3 for the peer.
bench-env: $(BENCH)/.installed
$(BENCH)/.installed:
	command -v wrk >/dev/null && ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
		{ SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); $$SUDO apt-get update -qq && \
		  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq wrk postgresql >/dev/null; }
	python3 -m venv $(BENCH)
	$(BENCH)/bin/pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(BENCH)/bin/pip install --quiet mosaicml-streaming==0.13.0 torchdata==0.11.0 torchtitan==0.2.2 torchft==0.2.0
	$(BENCH)/bin/pip install --quiet pydantic pyyaml typer rich tokenizers pyarrow fsspec safetensors matplotlib \
		xxhash s3fs boto3 'moto[server]'
	$(BENCH)/bin/pip install --quiet --no-deps -e .
	touch $@

clean:
	rm -rf $(VENV) $(BENCH) runs .pytest_cache
