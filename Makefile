# Two commands for a fresh machine (README.md):
#   make demo   install into .venv and train `tiny` on the default corpus
#   make test   install into .venv and run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU wheel of this release is on local disk here; on a GPU box pip takes the CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: install
	$(VENV)/bin/tenfold train

test: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
