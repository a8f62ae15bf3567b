# Two commands for a fresh machine (README.md):
#   make demo   install into .venv and train `tiny` on the default corpus
#   make test   install into .venv and run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
# On a CPU-only machine install a CPU wheel of this release first; on a GPU box pip takes the CUDA build.
TORCH_SPEC ?= torch==2.13.0

# Python 3.10, the lowest Python tenfold supports. Only the torch-free tests run there (the
# package index's torch 2.13 for CPython 3.10 is the CUDA build, gigabytes of CUDA libraries);
# every module is still byte-compiled by 3.10.
PY310 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10*/bin/python) python3.10)
VENV310 ?= .venv310
TESTS_WITHOUT_TORCH := tests/test_cli_config.py tests/test_fuzz_cli.py tests/test_deepspeed_json.py tests/test_plan_validation.py

.PHONY: install demo test test-fast test-py310 bench gpu-check clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# The next commands below are the README's "After the demo" block (tests/test_readme.py checks).
demo: install
	$(VENV)/bin/tenfold train --overwrite
	@echo ""
	@echo "Demo done: outputs in runs/tenfold/ (listed above). Next, from this folder:"
	@echo "  source .venv/bin/activate                                          # tenfold, tensorboard, torchrun on PATH"
	@echo "  tensorboard --logdir runs/tenfold/tensorboard                      # the curves in a browser"
	@echo "  tenfold train --steps 300 --resume auto                            # continue from the final checkpoint"
	@echo "  tenfold export runs/tenfold --dtype bf16 --out model.safetensors   # the weights as one 16-bit file"
	@echo "  tenfold plan --model tiny --gpu cpu --micro-batch 8 --seq-len 256  # the planner's forecast of this run"
	@echo "More in README.md; examples/ has a TOML config, the recipe's DeepSpeed JSON and a SLURM script."

# --durations: the 25 slowest tests in the output, so a test that grows slow is visible in CI
test: install
	$(PY) -m pytest -q --durations=25

# Unit tests only: no test that starts several processes, no multi-minute test (a few minutes).
test-fast: install
	$(PY) -m pytest -q -m "not multiprocess and not slow"

test-py310: $(VENV310)/.installed
	$(VENV310)/bin/python -m compileall -q src tests
	$(VENV310)/bin/python -m pytest -q -p no:cacheprovider $(TESTS_WITHOUT_TORCH)

# tenfold without its dependencies, then the torch-free ones it imports on these paths
$(VENV310)/.installed: pyproject.toml
	$(PY310) -m venv $(VENV310)
	$(VENV310)/bin/python -m pip install -q --no-deps -e .
	$(VENV310)/bin/python -m pip install -q "pydantic>=2.5" "rich>=13" "hjson>=3.0" "tomli>=1.1" "tomli-w>=1.0" "pytest>=7" "hypothesis>=6.100"
	touch $@

# On a CUDA machine: the ~1B preset on one GPU, ZeRO-Offload and FP8 on one, then ZeRO-3, TP, HSDP
# and a Hugging Face pipeline on several, within 8 minutes; results in gpu_check.json
# (benchmarks/gpu_check.py, docs/benchmarks.md)
gpu-check: install
	$(PY) benchmarks/gpu_check.py --out gpu_check.json

clean:
	rm -rf $(VENV) $(VENV310) runs .pytest_cache
