# Set-up is two commands: `make demo` and `make test`. Both create .venv on first use.
# torch: an importable torch >= 2.4 (e.g. your CUDA build, seen through --system-site-packages)
# is kept; otherwise $(TORCH) is installed. Override with e.g. `make test TORCH="torch==2.5.1"`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: demo test lint venv clean horovod dali ci-env

$(VENV)/.torch:
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch, sys; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 4))" 2>/dev/null \
	  || $(PIP) "$(TORCH)"
	touch $@

$(VENV)/.base: $(VENV)/.torch pyproject.toml
	$(PIP) -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PIP) -e ".[test]"
	touch $@

venv: $(VENV)/.base

demo: $(VENV)/.base
	$(VENV)/bin/fastvision train unet2d-microscopy

# Tests run in $(TEST_WORKERS) pytest-xdist workers of $(TEST_THREADS) torch thread(s) each: most
# tests are small or wait on subprocesses, so two single-thread workers beat one two-thread process
# on a 2-core machine. `make test TEST_WORKERS=0` runs in one process.
TEST_WORKERS ?= 2
TEST_THREADS ?= 1
test: $(VENV)/.test
	OMP_NUM_THREADS=$(TEST_THREADS) $(PY) -m pytest -q -m "not gpu" -n $(TEST_WORKERS) $(PYTEST_ARGS)

# ruff (the version the [lint] extra pins; rules in pyproject.toml): pyflakes, bugbear, pycodestyle
# (line length 120), import order, pyupgrade, over the package, its tests, benchmarks and scripts;
# then the size rule: no module in fastvision/ over 400 lines, no function over 60.
$(VENV)/.lint: $(VENV)/.base
	$(PIP) -e ".[lint]"
	touch $@

lint: $(VENV)/.lint
	$(VENV)/bin/ruff check fastvision tests benchmarks scripts
	$(PY) scripts/check_sizes.py fastvision

clean:
	rm -rf $(VENV) runs

# Optional NVIDIA DALI (data.args.backend: dali; its CPU pipelines run without a GPU): the [dali]
# extra, about 200 MB. `make test` then runs tests/data/test_dali.py instead of skipping it.
$(VENV)/.dali: $(VENV)/.base
	$(PIP) -e ".[dali]"
	touch $@

dali: $(VENV)/.dali

# CI's environment in one pip call (.ci/run): the [test], [lint] and [dali] extras together, so the
# editable build and the dependency resolution run once instead of once per extra; then the stamps
# the separate targets would leave, so `make test` and `make lint` find everything installed.
ci-env: $(VENV)/.torch
	$(PIP) -e ".[test,lint,dali]"
	touch $(VENV)/.base && touch $(VENV)/.test $(VENV)/.lint $(VENV)/.dali

# Opt-in (about 8 min on 2 cores): horovod 0.28.1, its last release, built from source into $(VENV)
# with gloo and no MPI, so `--backend horovod` and `scale --backends ddp,horovod` work. Where the
# venv's torch sees CUDA and nvcc is on PATH, GPU all-reduce is built with NCCL
# (HOROVOD_GPU_OPERATIONS=NCCL, as every seed's Horovod runs on GPUs), using the NCCL that torch's
# nvidia-nccl wheel ships unless HOROVOD_NCCL_HOME is set; otherwise CPU only (gloo).
# 0.28.1 compiles with -std=c++14 but torch 2.x headers need C++17, and CXXFLAGS alone cannot
# override it: $(HVD_CXX) is a compiler wrapper that rewrites the flag. It needs cmake 3.x (4.x
# rejects its CMakeLists) and --no-build-isolation so the build sees the installed torch.
HOROVOD ?= horovod==0.28.1
HVD_CXX := $(abspath $(VENV))/bin/cxx17-for-horovod

horovod: $(VENV)/.base
	$(PY) -m pip install -q "cmake>=3.13,<4" wheel setuptools
	printf '%s\n' '#!/bin/sh' \
	  '# written by `make horovod`: rewrite -std=c++14 to C++17 (torch headers need it)' \
	  'for a in "$$@"; do shift; case "$$a" in -std=c++14) a=-std=c++17;; -std=gnu++14) a=-std=gnu++17;; esac; set -- "$$@" "$$a"; done' \
	  'exec $${HOROVOD_REAL_CXX:-c++} "$$@"' > $(HVD_CXX)
	chmod +x $(HVD_CXX)
	set -e; gpu=; \
	if command -v nvcc >/dev/null && $(PY) -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then \
	  nccl=$${HOROVOD_NCCL_HOME:-$$($(PY) -c "import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))" 2>/dev/null)}; \
	  gpu="HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_CUDA_HOME=$$(dirname $$(dirname $$(command -v nvcc)))"; \
	  [ -z "$$nccl" ] || gpu="$$gpu HOROVOD_NCCL_HOME=$$nccl HOROVOD_NCCL_LINK=SHARED"; \
	  echo "building horovod with NCCL: $$gpu"; \
	else echo "building horovod for CPU (gloo): no CUDA torch or no nvcc"; fi; \
	env $$gpu PATH="$(abspath $(VENV))/bin:$$PATH" CXX=$(HVD_CXX) HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 \
	  HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
	  $(PY) -m pip install --no-build-isolation --no-cache-dir "$(HOROVOD)"
	$(PY) -c "import horovod.torch as hvd; print('horovod.torch ok; gloo built:', hvd.gloo_built(), '; nccl built:', hvd.nccl_built())"
