"""A rank's watcher thread (``worker/signal_watcher.py``): besides the signals, it reads the fds it
is given and starts what can wait, in a fresh interpreter (its SIGTERM handler and wakeup fd are
the process's own), so that a rank whose call ends within ``FLUSH_INTERVAL_S`` runs one thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])

GIVEN_BEFORE_AND_AFTER_THE_START = """
import os, signal, socket, threading, time
from accelnb.worker.signal_watcher import watch_signals

def reader_of(sock, name, heard, done):
    def read():
        data = sock.recv(100)
        if not data:
            done.set()
            return False
        heard.append((name, data, threading.current_thread().name))
        if data == b"fail":
            raise ValueError("a reader's own failure")
        return True
    return read

heard, ended = [], threading.Event()
before_ours, before_theirs = socket.socketpair()
after_ours, after_theirs = socket.socketpair()
started_at = []
watcher = watch_signals(wake=lambda: None, start=False)
watcher.read_too(before_ours.fileno(), reader_of(before_ours, "before", heard, ended))
t0 = time.monotonic()
watcher.start_in_a_while(0.2, lambda: started_at.append(time.monotonic() - t0))
watcher.start()
before_theirs.send(b"one")
deadline = time.monotonic() + 20
while len(heard) < 1 and time.monotonic() < deadline:
    time.sleep(0.005)
watcher.read_too(after_ours.fileno(), reader_of(after_ours, "after", heard, ended))  # the thread waits in select
after_theirs.send(b"two")
while len(heard) < 2 and time.monotonic() < deadline:
    time.sleep(0.005)
before_theirs.send(b"fail")  # its reader raises: it is dropped, the watcher goes on
while len(heard) < 3 and time.monotonic() < deadline:
    time.sleep(0.005)
after_theirs.close()  # end of file: its reader says so, and is read no more
ended.wait(20)
while not started_at and time.monotonic() < deadline:
    time.sleep(0.005)
print("heard:", heard)
print("started after:", started_at)
os.kill(os.getpid(), signal.SIGTERM)  # still the watcher's: it flushes, then the process dies of it
time.sleep(20)
print("still alive")
"""


def test_the_watcher_reads_what_it_is_given_starts_later_work_in_time_and_still_hears_sigterm() -> None:
    done = subprocess.run([sys.executable, "-c", GIVEN_BEFORE_AND_AFTER_THE_START], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == -15, done.stdout + done.stderr  # died of SIGTERM, as a rank without a handler of its own
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert eval(lines["heard"]) == [("before", b"one", "accelnb-signals"), ("after", b"two", "accelnb-signals"),
                                    ("before", b"fail", "accelnb-signals")]
    (after,) = eval(lines["started after"])
    assert 0.2 <= after < 15, after
    assert "still alive" not in done.stdout
