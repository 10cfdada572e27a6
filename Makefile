# The README's commands. Each installs what it needs into .venv first (once; again when
# pyproject.toml or constraints.txt change), on CPU or, where nvidia-smi is found, with CUDA, or, on a TPU VM
# (TPU chips as /dev/accel* on v4 and v5e, /dev/vfio/<n> on v5p and v6e), with libtpu (the tpu extra).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TPU_CHIPS ?= $(wildcard /dev/accel* /dev/vfio/[0-9]*)
comma := ,
EXTRAS := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo dev,cuda12 || echo dev$(if $(TPU_CHIPS),$(comma)tpu))
ARGS ?=

.PHONY: install train test test-isa check lint test-slow test-all bench h100-env tpu-env roofline clean

$(VENV)/.installed-$(EXTRAS): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "jaxlm needs Python 3.11 or newer; set PYTHON=python3.11 (or newer)")'
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[$(EXTRAS)]'
	@rm -f $(VENV)/.installed-*
	@touch $@

install: $(VENV)/.installed-$(EXTRAS)

train: install  ## train configs/tiny.py on the built-in corpus; ARGS="--config.run.steps=100" to override
	$(BIN)/python -m jaxlm.train --config=configs/tiny.py $(ARGS)

# pytest-xdist: the suite in one worker per core (at most 4; each holds a JAX with 8 fake devices), a test file
# per worker (--dist loadfile: a module's fixtures are built once). Each worker peaks near 2.4 GB of memory (two
# took 5.3-5.4 GB in all on 2 cores): PYTEST_WORKERS=2 caps them, PYTEST_WORKERS=0 runs the suite in one process.
PYTEST_WORKERS ?= auto
PARALLEL := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --maxprocesses=4 --dist loadfile)

test: install  ## lint (ruff, configured in pyproject.toml), then the default suite (CPU, 8 fake devices; its budget 10 minutes on 2 cores)
	$(BIN)/ruff check .
	JAXLM_TEST_FAST_COMPILE=1 $(BIN)/python -m pytest -q $(PARALLEL) $(ARGS)

# XLA:CPU generates code for the processor it runs on, so floats' last bits differ between instruction sets;
# --xla_cpu_max_isa makes it generate code as for an older x86 processor on this one (tests/floats.py); as for
# one without F16C (SSE4_2, AVX) the tests compile optimized code (tests/conftest.py).
ISAS ?= AVX2 SSE4_2

test-isa: install  ## the tests that compare floats (marked `floats`), as `make test` runs them, as on each of ISAS (x86)
	@for isa in $(ISAS); do echo "--- XLA:CPU as on $$isa"; \
	  XLA_FLAGS="$$XLA_FLAGS --xla_cpu_max_isa=$$isa" JAXLM_TEST_FAST_COMPILE=1 \
	    $(BIN)/python -m pytest -q $(PARALLEL) -m 'floats and not slow' $(ARGS) || exit 1; done

check: install  ## the lint, then every test, slow ones included (about 45 minutes on 2 cores; the slow ones alone 30-34); CI runs `make test`
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m '' $(ARGS)

lint: install  ## ruff alone
	$(BIN)/ruff check .

test-slow: install  ## the slow tests only
	$(BIN)/python -m pytest -q -m slow $(ARGS)

test-all: install
	$(BIN)/python -m pytest -q -m '' $(ARGS)

bench: install  ## the MFU harness: 1b on a GPU, tiny on a CPU; ARGS="--recipe 125m --sweep model.remat=none,dots"
	$(BIN)/python benchmarks/mfu.py $(if $(ARGS),$(ARGS),$(if $(shell command -v nvidia-smi),--recipe 1b,--recipe tiny))

# XLA's CUDA compiler without a GPU (2.6 GB, installed only on request): compiles the real H100 program on
# this machine for `python -m jaxlm.plan --target=h100` and benchmarks/roofline.py. Pinned to the jax above;
# tokamax: the MoE's grouped GEMM (model.moe_impl=tokamax, auto's choice on GPUs), compiled here as on an H100.
H100_VENV := .venv-h100
H100_PACKAGES := jax-cuda13-plugin==0.10.2 jax-cuda13-pjrt==0.10.2 nvidia-cudnn-cu13==9.28.1.4 tokamax==0.0.12

$(H100_VENV)/.installed: pyproject.toml constraints.txt
	@test -x $(H100_VENV)/bin/python || $(PYTHON) -m venv $(H100_VENV)
	$(H100_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(H100_VENV)/bin/python -m pip install --quiet -c constraints.txt -e . $(H100_PACKAGES)
	@touch $@

h100-env: $(H100_VENV)/.installed  ## the H100 compiler environment (.venv-h100, 2.6 GB; no GPU needed)

# XLA's TPU compiler without a TPU (libtpu, 1.8 GB with the rest, installed only on request): compiles the real
# TPU program (v5e, v5p, v6e) on this machine for `python -m jaxlm.plan --target=v5p --topology=v5p:2x2x1`. The
# tpu extra: jax[tpu], whose libtpu constraints.txt pins to the one jax[tpu] of the jax above requires.
TPU_VENV := .venv-tpu

$(TPU_VENV)/.installed: pyproject.toml constraints.txt
	@test -x $(TPU_VENV)/bin/python || $(PYTHON) -m venv $(TPU_VENV)
	$(TPU_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TPU_VENV)/bin/python -m pip install --quiet -c constraints.txt -e '.[tpu]'
	@touch $@

tpu-env: $(TPU_VENV)/.installed  ## the TPU compiler environment (.venv-tpu, 1.8 GB; no TPU needed)

roofline: h100-env  ## compile recipes for H100s here and print their rooflines; ARGS="--recipe 1b --devices 8"
	$(H100_VENV)/bin/python benchmarks/roofline.py $(ARGS)

clean:
	rm -rf $(VENV) $(H100_VENV) $(TPU_VENV) .cache runs .pytest_cache
