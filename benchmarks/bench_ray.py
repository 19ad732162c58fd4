"""``cluster="ray"`` on a two-node Ray cluster, next to Ray Train's ``TorchTrainer``: one run.

    sudo .venv/bin/python benchmarks/bench_ray.py      # needs root (network namespaces); make bench runs it

Two network namespaces joined by a veth pair are the two nodes (``tests/ray_nodes.py``: Ray
replaces 127.0.0.1 with the machine's address, so no Ray node starts outside a namespace made for
it), 1 CPU each. A driver script inside the head's namespace times, for one function (join the
gloo group, one ``all_reduce``, return a value) on 2 ranks, one on each node:

- accelnb's first launch (fresh actors: a Python process per rank imports torch and accelnb);
- a second one-shot launch;
- a persistent session's start, and its warm re-runs on the same actors (median of 5);
- ``TorchTrainer(...).fit()`` with ``ScalingConfig(num_workers=2)``, if ``ray[train]`` is installed
  (``make bench`` installs it; the test set-up does not).

One run each, printed as a table; the load average is printed with it, since a shared 2-core
machine makes every number noisy. Nothing is asserted.

Measured 2026-11-24 (2 cores shared with other jobs, load average 7): accelnb first launch 5.0 s,
second one-shot launch 9.1 s (fresh actors again; the first found Ray's pre-started workers),
session start and first run 7.8 s, warm re-run 13 ms (median of 5); TorchTrainer.fit() 41.2 s,
and its result carries no return value.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.ray_nodes import INTERFACE, NamespaceCluster, netns_unavailable, ray_unavailable  # noqa: E402

DRIVER = r'''
import os, statistics, sys, tempfile, time
import ray
ray.init(address=sys.argv[1])
from accelnb import Session, launch

def step():
    import torch, torch.distributed as dist
    total = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(total)
    return total.item()

rows = []
began = time.perf_counter(); value = launch(step, num_processes=2, cluster="ray", quiet=True).values
rows.append(("accelnb first launch (fresh actors)", time.perf_counter() - began, value))
began = time.perf_counter(); value = launch(step, num_processes=2, cluster="ray", quiet=True).values
rows.append(("accelnb second one-shot launch", time.perf_counter() - began, value))
began = time.perf_counter(); session = Session.start(cluster="ray", num_processes=2, quiet=True)
value = session.run(step).values
rows.append(("accelnb session start + first run", time.perf_counter() - began, value))
reruns = []
for _ in range(5):
    began = time.perf_counter(); value = session.run(step).values; reruns.append(time.perf_counter() - began)
rows.append(("accelnb warm re-run (session, median of 5)", statistics.median(reruns), value))
session.stop()
try:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
except ImportError as missing:
    rows.append((f"Ray Train TorchTrainer: not installed ({missing.name})", float("nan"), None))
else:
    def train_loop():
        import ray.train
        ray.train.report({"value": step()})
    # Ray Train leaves gloo's interface to the environment (accelnb sets it per rank): without it
    # gloo takes the hostname's address, 127.0.0.1 here, and the two nodes never meet.
    ray.shutdown()
    ray.init(address=sys.argv[1], runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": sys.argv[2]}})
    with tempfile.TemporaryDirectory() as storage:
        trainer = TorchTrainer(train_loop, scaling_config=ScalingConfig(num_workers=2),
                               run_config=RunConfig(storage_path=storage, name="bench"))
        began = time.perf_counter(); result = trainer.fit()
        rows.append(("Ray Train TorchTrainer.fit() (value not returned; metrics only)",
                     time.perf_counter() - began, (result.metrics or {}).get("value")))
print("RESULTS")
for name, seconds, value in rows:
    print(f"| {name} | {seconds:.3f} s | {value} |")
'''


def main() -> int:
    why_not = netns_unavailable() or ray_unavailable()
    if why_not:
        print(f"bench_ray: skipped: {why_not}")
        return 0
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as workdir, NamespaceCluster.two_nodes(Path(workdir)) as cluster:
        cluster.start_ray(cpus=1)
        script = Path(workdir) / "driver.py"
        script.write_text(DRIVER)
        done = subprocess.run(cluster.exec_in(0, [sys.executable, str(script), cluster.head_address, INTERFACE]),
                              capture_output=True, text=True, env=cluster.env(), timeout=900)
    if "RESULTS" not in done.stdout:
        print(done.stdout[-4000:], done.stderr[-4000:])
        return 1
    print("2 ranks on 2 Ray nodes (network namespaces, 1 CPU each), gloo; one run each")
    print(f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    print("| what | seconds | value |\n| --- | --- | --- |")
    print(done.stdout.split("RESULTS", 1)[1].strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
