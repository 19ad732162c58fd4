"""Accelerate's config file: what `accelerate launch` would give a script, a launch gives each rank.

The reference is Accelerate itself: ``accelerate launch --config_file f.yaml`` runs a script that
dumps its environment, and every ``ACCELERATE_*``/``FSDP_*`` variable it saw must be what a rank
of ``launch(..., config_file=f.yaml)`` sees. Bad files fail before anything starts, naming the
file and the key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import accelnb
from accelnb import LaunchConfigError, launch, synthetic_inventory
from accelnb.notebook.magic import parse_cell_line, parse_start_options
from tests.conftest import worker_processes

pytestmark = pytest.mark.usefixtures("no_leftovers")

FSDP = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_use_orig_params: true
  fsdp_version: 2
dynamo_config:
  dynamo_backend: INDUCTOR
  dynamo_mode: max-autotune
mixed_precision: bf16
num_machines: 1
num_processes: 2
"""
MULTI_CPU = """\
distributed_type: MULTI_CPU
mixed_precision: bf16
num_processes: 2
use_cpu: true
dynamo_config:
  dynamo_backend: EAGER
"""
DUMP_ENV = """\
import json, os, sys
with open(os.path.join(sys.argv[1], f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
    json.dump(dict(os.environ), f)
"""
ACCELERATE_KEYS = ("ACCELERATE_", "FSDP_")


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def environment() -> dict[str, str]:
    return dict(os.environ)


def accelerate_settings(env: dict[str, str]) -> dict[str, str]:
    # ACCELERATE_USE_CPU is accelnb's for every CPU rank (so Accelerator() on a CPU rank never
    # takes a GPU); its meaning is compared separately where the file sets it.
    return {k: v for k, v in env.items() if k.startswith(ACCELERATE_KEYS) and k != "ACCELERATE_USE_CPU"}


def what_accelerate_launch_gives(config: str, tmp_path: Path) -> dict[str, str]:
    script = write(tmp_path, "dump_env.py", DUMP_ENV)
    out = tmp_path / "out"
    out.mkdir()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ACCELERATE_KEYS)}
    subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, script, str(out)],
                   check=True, env=clean, capture_output=True, timeout=120)
    return json.loads((out / "rank0.json").read_text())


@pytest.mark.parametrize("text", [FSDP, MULTI_CPU], ids=["fsdp", "multi_cpu"])
def test_each_rank_gets_the_environment_accelerate_launch_gives(text: str, tmp_path: Path) -> None:
    config = write(tmp_path, "config.yaml", text)
    theirs = what_accelerate_launch_gives(config, tmp_path)
    # On a machine without GPUs (injected, so that a GPU machine runs the same test): the file's
    # num_processes places 2 CPU ranks.
    result = launch(environment, config_file=config, inventory=synthetic_inventory(0), quiet=True)
    assert sorted(result.values) == [0, 1]  # num_processes: 2 from the file
    for rank_env in result.values.values():
        assert accelerate_settings(rank_env) == accelerate_settings(theirs)
    if "use_cpu: true" in text:
        assert theirs["ACCELERATE_USE_CPU"].lower() == result.values[0]["ACCELERATE_USE_CPU"].lower() == "true"
    assert result.values[1]["RANK"] == "1" and result.values[1]["WORLD_SIZE"] == "2"


def accelerator_settings() -> tuple[str, str, int, str]:
    from accelerate import Accelerator

    accelerator = Accelerator()
    return (accelerator.mixed_precision, accelerator.distributed_type.value, accelerator.num_processes,
            accelerator.state.dynamo_plugin.backend.value)


def test_accelerator_in_the_function_sees_the_file_and_keywords_win(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    config = write(tmp_path, "cpu.yaml", MULTI_CPU)
    assert launch(accelerator_settings, config_file=config).values[1] == ("bf16", "MULTI_CPU", 2, "EAGER")
    table = capsys.readouterr().out
    assert f"from {config}: distributed_type MULTI_CPU, num_processes 2, mixed_precision bf16, dynamo_config (1)" \
        in table, table
    assert launch(accelerator_settings, config_file=config, mixed_precision="no", num_processes=1).values == {
        0: ("no", "MULTI_CPU", 1, "EAGER")}  # a launched rank is always in a process group
    assert "keywords won for num_processes, mixed_precision" in capsys.readouterr().out


def test_the_plan_says_what_came_from_the_file(tmp_path: Path) -> None:
    config = write(tmp_path, "gpus.yaml", "distributed_type: MULTI_GPU\nnum_processes: 2\ngpu_ids: 5,7\n")
    p = accelnb.plan(config_file=config, inventory=synthetic_inventory(8))
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in p.ranks] == ["5,7", "5,7"]
    assert f"from {config}: distributed_type MULTI_GPU, num_processes 2, gpu_ids 5,7" in p.table()
    overridden = accelnb.plan(config_file=config, gpus="1,2", inventory=synthetic_inventory(8))
    assert overridden.ranks[0].env["CUDA_VISIBLE_DEVICES"] == "1,2"
    assert "keywords won for gpus" in overridden.table()
    uncounted = write(tmp_path, "uncounted.yaml", "distributed_type: MULTI_GPU\n")  # `accelerate launch` would ask
    assert len(accelnb.plan(config_file=uncounted, inventory=synthetic_inventory(4)).ranks) == 4


def test_the_magic_takes_config_and_gpus_per_rank() -> None:
    given, _ = parse_cell_line("--config fsdp.yaml --gpus-per-rank 2")
    assert given == {"config_file": "fsdp.yaml", "gpus_per_rank": 2}
    assert parse_start_options("--config default") == {"config_file": "default"}


@pytest.mark.parametrize(("name", "text", "keywords", "message"), [
    ("missing.yaml", None, {}, "missing.yaml does not exist. To fix it, check the path"),
    ("bad.yaml", "distributed_type: FSDP\nfsdp_config: [unclosed\n", {}, "bad.yaml is not valid YAML: "),
    ("type.yaml", "distributed_type: MULTI_TPU\n", {},
     "type.yaml: distributed_type: MULTI_TPU is not one accelnb can launch. Use one of NO, MULTI_CPU, "
     "MULTI_GPU, FSDP, DEEPSPEED"),
    ("untyped.yaml", "num_processes: 2\n", {}, "untyped.yaml has no distributed_type key"),
    ("ids.yaml", "distributed_type: MULTI_GPU\nnum_processes: 2\ngpu_ids: 0,1,2\n", {},
     "ids.yaml: num_processes: 2 conflicts with gpu_ids: 0,1,2 (3 GPU(s))"),
    ("gpus.yaml", "distributed_type: MULTI_GPU\nnum_processes: 4\n", {"gpus": "0,1"},
     "gpus.yaml: num_processes: 4 conflicts with gpus='0,1' (2 GPU(s))"),
    ("all.yaml", "distributed_type: MULTI_GPU\nnum_processes: 9\n", {},
     "num_processes=9 asks for more GPUs than the 8 visible (0 (Synthetic GPU (no hardware)), "),
    ("bare_no.yaml", "distributed_type: NO\n", {}, "bare_no.yaml: distributed_type: NO must be quoted"),
    ("unknown_key.yaml", "distributed_type: 'NO'\nnum_procs: 2\n", {},
     "Accelerate refuses {path}: The config file at {path} had unknown keys (['num_procs'])"),
    ("cpu.yaml", "distributed_type: MULTI_CPU\n", {}, "cpu.yaml: distributed_type: MULTI_CPU runs CPU ranks, but the "
     "file has no num_processes"),
])
def test_bad_files_are_refused_before_anything_starts(name: str, text: str | None, keywords: dict[str, Any],
                                                      message: str, tmp_path: Path) -> None:
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(LaunchConfigError) as refused:
        launch(environment, config_file=str(path), inventory=synthetic_inventory(8), **keywords)
    assert message.format(path=path) in str(refused.value)
    assert str(path) in str(refused.value)
    assert worker_processes() == []


def test_deepspeed_without_deepspeed_installed_says_so(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    if _installed("deepspeed"):
        pytest.skip("deepspeed is installed here")
    path = write(tmp_path, "ds.yaml", "distributed_type: DEEPSPEED\nnum_processes: 2\n"
                                      "deepspeed_config:\n  zero_stage: 2\n")
    with pytest.raises(LaunchConfigError) as refused:
        launch(environment, config_file=path, num_processes=2, cpu=True)
    assert f"{path}: distributed_type: DEEPSPEED, but deepspeed is not installed" in str(refused.value)
    assert "pip install deepspeed" in str(refused.value)
    assert worker_processes() == []


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_default_is_the_file_accelerate_config_writes(tmp_path: Path) -> None:
    """In a fresh interpreter: Accelerate computes its default path from HF_HOME when imported."""
    probe = textwrap.dedent("""
        import accelnb
        from accelnb import LaunchConfigError
        try:
            accelnb.plan(config_file="default")
        except LaunchConfigError as missing:
            print("MISSING", missing)
        from accelerate.commands.config.default import write_basic_config
        write_basic_config(mixed_precision="bf16")
        print("TABLE", accelnb.plan(config_file="default", num_processes=1).table())
    """)
    env = {**os.environ, "HF_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    default = tmp_path / "accelerate" / "default_config.yaml"
    assert f"MISSING config_file='default': {default} does not exist. To fix it, run `accelerate config`" in out
    assert f"from {default}: distributed_type NO, " in out and "mixed_precision bf16" in out, out
