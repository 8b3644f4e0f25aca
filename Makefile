# One command each: make demo, make test, make bench, make lint (make faults and make chaos: RELIABILITY.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Two stamps: shardflow and what it runs on (enough for the demo), then the test extra (TensorFlow, the oracle of
# the compat tests, is 1.3 GB of it).
BASE := $(VENV)/.installed-base
STAMP := $(VENV)/.installed

.PHONY: demo test bench faults chaos lint clean

$(BASE): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	touch $(BASE)

$(STAMP): $(BASE)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# Where the environment sets PYTHONDONTWRITEBYTECODE, every process of a job (the chief, the zygote, each role)
# compiles shardflow's sources again: ~0.2 s of CPU each, about a tenth of the test suite's time on 2 cores. So the
# bytecode is written once here; a process reads it as ever, and recompiles a source changed since.
COMPILE := $(PY) -m compileall -q src tests examples benchmarks

demo: $(BASE)
	$(COMPILE)
	$(PY) examples/char_lm.py --model-dir runs/demo-$$(date +%Y%m%d-%H%M%S)

# Three test processes, one file each at a time: most integration tests wait on sockets and deadlines, so two keep
# the 2 cores busy most of the time (about 40% faster than one) and a third fills the rest (on 2 cores: 757 and 834 s
# against 880-920 s with two); a file's tests stay in one process, in their order. The 15 slowest tests are listed
# at the end, to see what to trim when the suite nears its 15 minutes.
TEST_WORKERS ?= 3
test: $(STAMP)
	$(COMPILE)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

# Every benchmark beside its peers; stores each result in benchmarks/results/ and rewrites BENCHMARKS.md.
bench: $(STAMP)
	$(COMPILE)
	$(PY) benchmarks/run_all.py

# Each fault injected into real jobs 3 times at random moments; writes RELIABILITY.md (about 5 minutes).
faults: $(STAMP)
	$(PY) benchmarks/faults.py

# Random roles killed and hung at random moments of real jobs for 10 minutes; writes its block of RELIABILITY.md.
# `python benchmarks/chaos.py --minutes N --seed S` for another length or the same schedule again.
chaos: $(STAMP)
	$(PY) benchmarks/chaos.py

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy --explicit-package-bases tests

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
