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

# The next commands below are the README's "After the demo" block (tests/test_readme.py checks).
demo: install
	$(VENV)/bin/tenfold train
	@echo ""
	@echo "Demo done: outputs in runs/tenfold/ (listed above). Next, from this folder:"
	@echo "  source .venv/bin/activate                                          # tenfold, tensorboard, torchrun on PATH"
	@echo "  tensorboard --logdir runs/tenfold/tensorboard                      # the curves in a browser"
	@echo "  tenfold train --steps 300 --resume auto                            # continue from the final checkpoint"
	@echo "  tenfold export runs/tenfold --dtype bf16 --out model.safetensors   # the weights as one 16-bit file"
	@echo "  tenfold plan --model tiny --gpu cpu --micro-batch 8 --seq-len 256  # the planner's forecast of this run"
	@echo "More in README.md; examples/ has a TOML config, the seed's DeepSpeed JSON and a SLURM script."

test: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
