"""Fixtures of the fault matrix, and the record that docs/faults.md is generated from.

Each fault test fills the ``fault_record`` fixture with what the user saw (exception type, first
line of the message) and how long cleanup took; the outcome of the test is added by the report
hook, and at the end of the session the entries are merged into ``test-artifacts/faults.json``
(git-ignored). ``python tests/faults/render_table.py`` turns that into docs/faults.md.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # faultkit, for these tests and their workers

# Not pytest's cache: the project's addopts may disable the cache provider.
RECORD_PATH = Path(__file__).resolve().parents[2] / "test-artifacts" / "faults.json"
_record: dict[str, dict[str, Any]] = {}


@pytest.fixture
def helper_pid() -> int:
    """The kernel's helper process, started before the test (its start is not part of any
    measurement). Per test: the own-fault tests kill it, and the next test gets a fresh one."""
    from accelnb.kernel.helper.template import shared_helper

    return shared_helper().pid


@pytest.fixture
def fault_record(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    entry: dict[str, Any] = {"test": request.node.nodeid, "recorded_at": time.strftime("%Y-%m-%d %H:%M")}
    _record[request.node.nodeid] = entry
    yield entry


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    entry = _record.get(item.nodeid)
    if entry is not None and (report.when == "call" or report.failed):
        entry["outcome"] = report.outcome
        if report.failed and call.excinfo is not None:
            entry["failure"] = str(call.excinfo.value).strip().splitlines()[0][:200] \
                if str(call.excinfo.value).strip() else call.excinfo.typename
    return report


def pytest_sessionfinish(session: pytest.Session) -> None:
    recorded = {nodeid: entry for nodeid, entry in _record.items() if "fault" in entry}
    if not recorded:
        return
    merged = {entry["test"]: entry for entry in _load_record()}
    merged.update(recorded)
    RECORD_PATH.parent.mkdir(exist_ok=True)
    tmp = RECORD_PATH.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(list(merged.values()), indent=1))
    os.replace(tmp, RECORD_PATH)


def _load_record() -> list[dict[str, Any]]:
    try:
        entries: list[dict[str, Any]] = json.loads(RECORD_PATH.read_text())
        return entries
    except (FileNotFoundError, json.JSONDecodeError):
        return []
