"""The doctor: each check judged on injected facts, the real one on this machine, and the magic.

Facts that lie outside the test (a small /dev/shm, a GPU held by another process) are built as
:class:`MachineFacts` / :class:`GpuFacts` and handed to ``run_checks``; nothing is patched. The
file limit is also lowered for real, on a subprocess, with ``resource``.
"""

from __future__ import annotations

import math
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

import accelnb
from accelnb import Check, DoctorReport
from accelnb.kernel.doctor.checks import (
    RENDEZVOUS_LOOKUP_SLOW_S,
    MachineFacts,
    ShmSpace,
    read_machine_facts,
    run_checks,
)
from accelnb.kernel.doctor.gpu_health import GpuFacts, GpuHealth
from tests.conftest import error_of, run_notebook, stream_text
from tests.silent_name_server import run_beside_a_silent_name_server

MB = 2**20


@pytest.fixture(scope="module")
def healthy() -> MachineFacts:
    """This machine's facts, with the parts a test varies set to a known good state."""
    return replace(read_machine_facts(), shm=ShmSpace(16 * 2**30, 16 * 2**30), open_files=(65536, 65536),
                   environ={}, torch_module=None, gpus=GpuFacts(driver=None, note="no NVIDIA driver"),
                   loopback_error=None, free_port=40000, rendezvous_lookup_s=0.002)


def test_healthy_facts_are_all_ok(healthy: MachineFacts) -> None:
    report = run_checks(healthy)
    assert report.worst == "ok", str(report)
    assert report.by_name("GPUs").detail.startswith("no NVIDIA GPU/driver: CPU ranks only")


def test_docker_sized_shm_warns_with_the_shm_size_fix(healthy: MachineFacts) -> None:
    check = run_checks(replace(healthy, shm=ShmSpace(64 * MB, 60 * MB))).by_name("/dev/shm")
    assert check.status == "warn"
    assert "64 MB" in check.detail and "--shm-size" in check.fix


def test_full_shm_warns_about_stale_segments(healthy: MachineFacts) -> None:
    check = run_checks(replace(healthy, shm=ShmSpace(8 * 2**30, 100 * MB))).by_name("/dev/shm")
    assert check.status == "warn" and "/dev/shm" in check.fix


def test_low_open_file_limit_warns_with_the_hard_limit_to_raise_to(healthy: MachineFacts) -> None:
    check = run_checks(replace(healthy, open_files=(1024, 524288))).by_name("open files")
    assert check.status == "warn" and "ulimit -n 524288" in check.fix


def test_low_open_file_limit_for_real_in_a_subprocess() -> None:
    def lower_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    code = "import accelnb; c = accelnb.doctor(show=False).by_name('open files'); print(c.status, '|', c.detail)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         preexec_fn=lower_limit).stdout
    assert out.startswith("warn | soft limit 256"), out


def test_risky_nccl_variables_are_named_with_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    report = accelnb.doctor(show=False)
    assert report.by_name("$NCCL_P2P_DISABLE").status == "warn"
    assert "peer-to-peer" in report.by_name("$NCCL_P2P_DISABLE").detail
    assert "del os.environ['CUDA_LAUNCH_BLOCKING']" in report.by_name("$CUDA_LAUNCH_BLOCKING").fix
    listed = report.by_name("NCCL/CUDA variables")
    assert listed.status == "ok" and "NCCL_DEBUG=INFO" in listed.detail


def test_cuda_initialised_in_the_kernel_is_fine_for_accelnb_and_says_why(healthy: MachineFacts) -> None:
    class FakeCuda:
        @staticmethod
        def is_initialized() -> bool:
            return True

    class FakeTorch:
        cuda = FakeCuda

    check = run_checks(replace(healthy, torch_module=FakeTorch)).by_name("CUDA in this kernel")
    assert check.status == "ok" and "notebook_launcher" in check.detail


def test_gpu_problems_are_each_reported(healthy: MachineFacts) -> None:
    gpus = GpuFacts(driver="550.54", gpus=(
        GpuHealth(0, "H100", mig_enabled=False, ecc_uncorrected=0, process_pids=(4242, 99)),
        GpuHealth(1, "H100", mig_enabled=True, ecc_uncorrected=3),
    ), peer_to_peer={(0, 1): False})
    report = run_checks(replace(healthy, gpus=gpus, own_pids=frozenset({99})))
    assert report.by_name("GPUs").detail.startswith("driver 550.54")
    held = report.by_name("GPU 0 in use")
    assert held.status == "warn" and "4242" in held.detail and "99" not in held.detail  # our own pid is ours
    assert report.by_name("GPU 1 MIG").status == "warn" and "-mig 0" in report.by_name("GPU 1 MIG").fix
    assert "3 uncorrected" in report.by_name("GPU 1 ECC").detail
    assert "0↔1" in report.by_name("peer-to-peer").detail
    with pytest.raises(KeyError):
        report.by_name("GPU 0 MIG")


def test_unreachable_loopback_fails(healthy: MachineFacts) -> None:
    report = run_checks(replace(healthy, loopback_error="Connection refused"))
    assert report.worst == "fail" and "ip link set lo up" in report.by_name("loopback").fix


def test_a_slow_name_lookup_of_the_rendezvous_address_warns_with_the_hosts_line(healthy: MachineFacts) -> None:
    assert run_checks(healthy).by_name("name lookup").status == "ok"
    check = run_checks(replace(healthy, rendezvous_lookup_s=1.2)).by_name("name lookup")
    assert check.status == "warn" and "1.20 s" in check.detail and "once per rank" in check.detail
    assert "::ffff:127.0.0.1 localhost-mapped' | sudo tee -a /etc/hosts" in check.fix
    unanswered = run_checks(replace(healthy, rendezvous_lookup_s=math.inf)).by_name("name lookup")
    assert unanswered.status == "warn" and "had no answer while accelnb waited" in unanswered.detail


def test_a_name_server_that_never_answers_is_found_by_the_real_lookup(tmp_path: Path) -> None:
    done = run_beside_a_silent_name_server("from accelnb.kernel.doctor.checks import time_rendezvous_lookup\n"
                                           "print(time_rendezvous_lookup(wait_s=5.0))\n", tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    seconds = float(done.stdout.split()[-1])
    assert 0.9 < seconds < 5.0, seconds  # the resolver's 1 s wait, then its failure
    check = run_checks(replace(read_machine_facts(), rendezvous_lookup_s=seconds)).by_name("name lookup")
    assert check.status == "warn" and "/etc/hosts" in check.fix


def test_one_lost_query_is_timed_again_and_not_taken_for_a_slow_name_server(tmp_path: Path) -> None:
    """The first query gets no answer (the resolver waits its 1 s), every later one an answer at
    once: the lookup is timed again, and the name server is found fast."""
    done = run_beside_a_silent_name_server(
        "import time\n"
        "from accelnb.kernel.doctor.checks import time_rendezvous_lookup\n"
        "started = time.monotonic()\n"
        "print(time_rendezvous_lookup(wait_s=5.0), time.monotonic() - started)\n",
        tmp_path, timeout=60, answers_after_the_first=True)
    assert done.returncode == 0, done.stderr
    seconds, waited = (float(word) for word in done.stdout.split()[-2:])
    assert waited > 0.9, waited  # the first lookup did wait for the lost answer: the test tested it
    assert seconds < RENDEZVOUS_LOOKUP_SLOW_S, seconds
    check = run_checks(replace(read_machine_facts(), rendezvous_lookup_s=seconds)).by_name("name lookup")
    assert check.status == "ok", check


def test_the_real_doctor_runs_quickly_and_finds_this_machine_fit(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.perf_counter()
    report = accelnb.doctor()
    seconds = time.perf_counter() - started
    table = capsys.readouterr().out
    assert isinstance(report, DoctorReport) and all(isinstance(c, Check) for c in report)
    assert table.startswith("accelnb doctor:") and "/dev/shm" in table and "open files" in table
    assert report.by_name("loopback").status == "ok"
    assert seconds < 20  # under 1 s when the machine is quiet; this bound only catches a check that hangs
    with capsys.disabled():
        print(f"\naccelnb.doctor() took {seconds * 1000:.0f} ms on this machine")


def test_the_report_renders_as_text_and_html() -> None:
    report = DoctorReport([Check("a", "ok", "fine"), Check("b <c>", "warn", "hm", "do x")])
    assert repr(report) == "<accelnb doctor: 1 ok, 1 warn, 0 fail>"
    assert "fix: do x" in str(report)
    assert "b &lt;c&gt;" in report.html_table()


def test_distributed_doctor_in_a_real_kernel() -> None:
    outputs = run_notebook(["%load_ext accelnb\n%distributed doctor", "%distributed doctor --procs 2"])
    assert error_of(outputs[0]) is None, outputs[0]
    text = stream_text(outputs[0])
    assert "accelnb doctor:" in text and "/dev/shm" in text and "loopback" in text
    assert not [o for o in outputs[0] if o["output_type"] == "execute_result"]  # the table shows once
    assert "UsageError: %distributed doctor takes no options" in stream_text(outputs[1], "stderr")
