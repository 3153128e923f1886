# `make demo` and `make test` create (or reuse) .venv and install everything they need.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU wheel; on a GPU machine use the torch that matches its CUDA: `make TORCH=torch demo`.
TORCH  ?= torch==2.13.0
# Triton for the CPU checks of the GPU kernels (interpreter, SM90 compile): beside the venv, not in it,
# so that the CPU torch never sees it. The version the lent H200 runs.
TRITON ?= triton==3.6.0
STAMP  := $(VENV)/.fp8train-installed

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	if [ "$$(uname -s)-$$(uname -m)" = Linux-x86_64 ]; then \
		$(BIN)/python -m pip install -q --no-deps --upgrade --target $(VENV)/triton-cpu "$(TRITON)"; fi
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fp8train demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -x tests

clean:
	rm -rf $(VENV) runs .pytest_cache
