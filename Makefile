# The two commands of the README: `make demo` (a real distributed run) and `make test`.
# Each first runs scripts/setup, which is idempotent and fast once done.
PY := .venv/bin/python

DIST := dist

.PHONY: setup demo test test-gpu lint typecheck soak bench dist wheel screenshots

setup:
	@bash scripts/setup

demo: setup
	$(PY) -m accelnb.demo

lint: setup
	.venv/bin/ruff check .

typecheck: setup
	.venv/bin/mypy
	.venv/bin/mypy benchmarks/*.py  # they call accelnb's insides: a changed signature fails here, not in a run

# Two test files at a time on a 2-core machine (a test waits on kernels and ranks as much as it
# computes: on a 2-core AMD EPYC VM 24 minutes one at a time, 19-22 two at a time, 10.5 on an
# Intel Xeon one; three at a time took 20, and a test that then allowed a launch 1 s failed), at
# most four on a bigger one (each worker starts kernels that import torch). A file stays on one
# worker: its module fixtures (a Ray cluster, a kernel) start once. The longest files go first (tests/conftest.py, LONGEST_FILES_FIRST).
test: setup lint typecheck
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder --durations=25  # the slowest tests, to keep `make test` near 12 minutes

# The GPU tier (tests/gpu/ and the other tests marked gpu): real CUDA on this machine's GPUs. A test
# that needs more GPUs than there are is skipped, and -rs lists each skip with the count it needs.
test-gpu: setup
	$(PY) -m pytest -q -rs -m gpu tests --ignore=tests/browser

# The README's pictures (docs/images/*.png), taken by the browser tests in a real JupyterLab and
# Chromium as they check what the panel and the cells show; any other screenshot goes to
# test-artifacts/ as always. Look at them before committing them.
screenshots: setup accelnb/labextension/static/style.js
	ACCELNB_PICTURES_DIR=docs/images $(PY) -m pytest -q -m browser tests/browser

soak: setup
	$(PY) -m pytest -q -m slow tests -s

bench: setup
	$(PY) -m pip install -q "accelerate>=1.0" "lightning>=2.4" ipyparallel  # benchmark-only peers; keeps the editable install
	$(PY) benchmarks/run_all.py
	$(PY) benchmarks/bench_session_cell.py  # a %%distributed cell vs a plain cell vs ipyparallel's %%px; session start
	$(PY) benchmarks/bench_first_launch.py --write
	$(PY) benchmarks/bench_accelerate_examples.py --write  # Accelerate's examples' style, in notebook order, against its launcher
	$(PY) benchmarks/bench_data.py --write
	$(PY) benchmarks/bench_torchrun.py --write  # %torchrun vs !torchrun in real kernels: first output, whole cell, Stop
	$(PY) benchmarks/bench_stop.py --write  # what stop_requested() costs a step, and how soon a Stop is answered
	$(PY) benchmarks/bench_features.py --write  # what each piece of the rank body costs a launch, a call, a step
	$(PY) benchmarks/bench_step_cost.py --write  # a rank's own work per training step, and the same loop against torchrun
	$(PY) benchmarks/bench_sweep.py --write  # accelnb.sweep: four configs on two slots, against a loop of launches and subprocesses
	$(PY) benchmarks/bench_huge_pages.py --write  # the template's memory on 2 MiB pages: a fork, an exit, a launch
	$(PY) benchmarks/bench_background_import.py --write  # launches while the template imports what training touches
	$(PY) -m pip install -q "ray[train]>=2.40"  # benchmark-only peer of cluster="ray": Ray Train's TorchTrainer
	$(PY) benchmarks/bench_ray.py  # needs root for network namespaces; says why when it skips

# What a user installs into an environment they already have (README, "Into an environment you
# already have"): the wheel, and an sdist, which carries the built JupyterLab extension so that a
# wheel built from it needs no node. Neither build runs jlpm: the hatch-jupyter-builder hook skips
# the build when accelnb/labextension/static/style.js exists, however old it is, so the rule below
# rebuilds the extension first if its sources changed since. pip puts the build requirements
# (hatchling, hatch-jupyter-builder, jupyterlab) in a throw-away environment, from its cache once
# it has them.
dist: setup accelnb/labextension/static/style.js
	rm -rf $(DIST)
	$(MAKE) --no-print-directory wheel
	$(PY) -m pip install -q build  # packaging-only peer: pip builds wheels, not sdists
	$(PY) -m build -q --sdist --outdir $(DIST) .

# The wheel alone, without setup: tests/test_install.py builds the wheel it installs with this
# (`make wheel PY=... DIST=...`), so the test and `make dist` cannot build different things.
wheel:
	$(PY) -m pip wheel -q --no-deps --wheel-dir $(DIST) .

accelnb/labextension/static/style.js: $(wildcard labextension/src/*.ts labextension/style/* labextension/schema/*) labextension/package.json
	bash scripts/build-labextension
	touch $@
