# One command each: `make demo` and `make test` create the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
DEMO_OUT ?= outputs/demo
PYTEST_ARGS ?=
# Test processes (pytest-xdist); each runs torch on one thread (tests/conftest.py). 2 halves the suite's wall time on
# a 2-core machine; `make test PYTEST_WORKERS=0` runs it in one process. The 25 slowest tests are listed at the end
# (the suite's budget is about 10 minutes: docs/measured.md).
PYTEST_WORKERS ?= 2
TIER ?= smoke
# Waiting OpenMP threads sleep instead of spinning (a spinning run on a shared machine can be many times slower);
# a value set in the environment wins. The ipa-probe commands set the same default themselves (docs/failures.md).
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: venv demo test test-compile test-matrix test-fast lint format hooks bench experiments figures figures-check screens clean

# Recipes run in bash with pipefail, so that a command piped through a filter still fails the target when it fails.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
# A machine whose pip configuration names local index folders (extra-index-url file:///...) gets one warning per
# package and folder that lacks it, over a hundred lines that say nothing about this project: the install drops
# those lines and keeps everything else pip prints. It also silences setuptools' reminder that an editable install
# is one.
PIP_NOISE := ^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.$$
PIP_QUIET := 2>&1 | { grep -v -E "$(PIP_NOISE)" || true; }

# torch and torchvision are installed as one matching pair (a torchvision built for another torch fails at import:
# "operator torchvision::nms does not exist"); a torch already in the environment is kept. Without an NVIDIA GPU (no
# working `nvidia-smi`) the pair is first asked of PyTorch's CPU index by exact version (+cpu), once, with no retries,
# so that pip does not fetch the CUDA build (about 6 GB, docs/machine.md); where that index cannot be reached, or
# lacks the pair, nothing is installed by that step and pip's default build of the same pair follows.
# `make venv TORCH_CPU_INDEX=` skips the CPU index.
TORCH_VERSION ?= 2.14.1
TORCHVISION_VERSION ?= 0.29.1
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
HAVE_TORCH := $(PY) -c "import torch" 2>/dev/null

$(STAMP): pyproject.toml
	@echo "creating $(VENV) and installing ipa-probe with its dependencies (a few minutes, once)"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip $(PIP_QUIET)
	@$(HAVE_TORCH) || nvidia-smi -L >/dev/null 2>&1 || [ -z "$(TORCH_CPU_INDEX)" ] || { \
		echo "no NVIDIA GPU: torch $(TORCH_VERSION)+cpu from $(TORCH_CPU_INDEX)"; \
		$(PY) -m pip install --quiet --retries 0 --timeout 10 --index-url $(TORCH_CPU_INDEX) \
			torch==$(TORCH_VERSION)+cpu torchvision==$(TORCHVISION_VERSION)+cpu >/dev/null 2>&1 \
		|| echo "not there: pip's default build of torch $(TORCH_VERSION) and torchvision $(TORCHVISION_VERSION)"; }
	@pair="torch==$(TORCH_VERSION) torchvision==$(TORCHVISION_VERSION)"; $(HAVE_TORCH) && pair=; \
		PYTHONWARNINGS='ignore:Editable installation' $(PY) -m pip install --quiet -e '.[dev]' $$pair $(PIP_QUIET)
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ipa-probe probe --out $(DEMO_OUT)

test: $(STAMP)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --durations=25 $(PYTEST_ARGS)

# The real torch.compile of the probe's statistics against eager (5-20 min of compiling on a 2-core CPU).
test-compile: $(STAMP)
	IPA_PROBE_TEST_COMPILE=1 $(PY) -m pytest -q tests/test_stats_compile.py

# Every ordered triple of features in tests/test_compose.py's matrix on the four test pipelines (the default run
# takes a covering set of them; the module docstring says what each covers and costs).
test-matrix: $(STAMP)
	IPA_PROBE_FULL_MATRIX=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) tests/test_compose.py -k test_triples

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -x $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check ipa_probe tests benchmarks notebooks
	$(VENV)/bin/ruff format --check ipa_probe tests benchmarks notebooks

format: $(STAMP)
	$(VENV)/bin/ruff check --fix ipa_probe tests benchmarks notebooks
	$(VENV)/bin/ruff format ipa_probe tests benchmarks notebooks

hooks:
	git config core.hooksPath hooks
	@echo "git hooks installed from hooks/ (pre-commit: ruff, notebook-output stripping, fast tests)"

bench: $(STAMP)
	$(PY) benchmarks/probe_overhead.py
	$(PY) benchmarks/nw_head.py
	$(PY) benchmarks/nw_field.py --quick
	$(PY) benchmarks/sweep_throughput.py

experiments: $(STAMP)
	$(VENV)/bin/ipa-probe experiments all --tier $(TIER) --out outputs/experiments-$(TIER)

# Every figure of README.md and docs/: the organism's commands rerun, the experiments' figures redrawn from their
# record.json (see docs/figures.md). `make figures-check` says which are not current.
figures: $(STAMP)
	$(PY) -m ipa_probe.devtools.figures

figures-check: $(STAMP)
	$(PY) -m ipa_probe.devtools.figures --check --rerun

# docs/screens/tensorboard.png: TensorBoard's first screen for docs/logging.md's command, by headless Chromium (which
# it needs; not part of `make test`).
screens: $(STAMP)
	$(PY) docs/screens/tensorboard_shot.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
