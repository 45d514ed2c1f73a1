# Set-up is two commands: `make demo` and `make test`. Both create .venv on first use.
# torch: an importable torch >= 2.4 (e.g. your CUDA build, seen through --system-site-packages)
# is kept; otherwise $(TORCH) is installed. Override with e.g. `make test TORCH="torch==2.5.1"`.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean horovod

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch, sys; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 4))" 2>/dev/null \
	  || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fastvision train unet2d-microscopy

test: $(STAMP)
	$(PY) -m pytest -q -m "not gpu" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .cache
