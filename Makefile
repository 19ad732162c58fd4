# The two commands of the README: `make demo` (a real distributed run) and `make test`.
# Each first runs scripts/setup, which is idempotent and fast once done.
PY := .venv/bin/python

.PHONY: setup demo test lint typecheck soak bench

setup:
	@bash scripts/setup

demo: setup
	$(PY) -m accelnb.demo

lint: setup
	.venv/bin/ruff check .

typecheck: setup
	.venv/bin/mypy

test: setup lint typecheck
	$(PY) -m pytest -q --durations=25  # the slowest tests, to keep `make test` near 12 minutes

soak: setup
	$(PY) -m pytest -q -m slow tests -s

bench: setup
	$(PY) -m pip install -q "accelerate>=1.0" "lightning>=2.4"  # benchmark-only peers; keeps the editable install
	$(PY) benchmarks/run_all.py
	$(PY) benchmarks/bench_first_launch.py --write
	$(PY) benchmarks/bench_data.py --write
	$(PY) -m pip install -q "ray[train]>=2.40"  # benchmark-only peer of cluster="ray": Ray Train's TorchTrainer
	$(PY) benchmarks/bench_ray.py  # needs root for network namespaces; says why when it skips
