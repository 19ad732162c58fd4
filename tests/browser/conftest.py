"""Fixtures for the browser tests: a throw-away JupyterLab server and headless Chromium.

The server runs from this venv on 127.0.0.1 with a free port, token auth and fresh config, data,
runtime, settings and workspace directories, with ``ACCELNB_SYNTHETIC_GPUS=4`` (kernels inherit
it: this machine has no GPU). JupyterLab finds the GPUs panel in the throw-away data directory,
linked to the working tree's build (``accelnb/labextension``), so the tests drive the extension
as last built here, not an older installed copy.

Chromium is Debian's (``apt-get install -y chromium fonts-liberation``), never Playwright's
download. Screenshots go to ``test-artifacts/``: every test that asks for one, and every failure.
The README's pictures are taken by the tests too (:func:`lab_page.save_picture`): into
``test-artifacts/`` as well, or into ``docs/images/`` under ``make screenshots``
(``ACCELNB_PICTURES_DIR=docs/images``).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = Path("/usr/bin/chromium")
BUILT_EXTENSION = REPO / "accelnb" / "labextension"
SYNTHETIC_GPUS = 4
# Where the README's pictures go: docs/images under `make screenshots`, else with the other screenshots.
PICTURES = REPO / os.environ.get("ACCELNB_PICTURES_DIR", "test-artifacts")
LIGHT_THEME = "JupyterLab Light"
DARK_THEME = "JupyterLab Dark"

# Kernels start slowly on two cores; Playwright's default 5 s is too short for them.
expect.set_options(timeout=30_000)


class LabServer:
    """A running JupyterLab: its address, token, notebook folder and REST API."""

    def __init__(self, url: str, token: str, root_dir: Path, process: subprocess.Popen[bytes]) -> None:
        self.url = url
        self.token = token
        self.root_dir = root_dir
        self.process = process

    def api(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                         headers={"Authorization": f"token {self.token}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            text = response.read()
        return json.loads(text) if text else None

    def create_notebook(self, name: str, cells: list[str]) -> str:
        """Write a notebook with these code cells (Python 3 kernel); return its path."""
        notebook = {
            "nbformat": 4, "nbformat_minor": 5,
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
            "cells": [{"cell_type": "code", "id": f"cell-{i}", "source": source, "metadata": {},
                       "outputs": [], "execution_count": None} for i, source in enumerate(cells)],
        }
        self.api("PUT", f"/api/contents/{name}", {"type": "notebook", "format": "json", "content": notebook})
        return name

    def notebook_url(self, path: str, workspace: str) -> str:
        # A workspace per test, so no test restores the tabs and panels another one left open.
        return f"{self.url}/lab/workspaces/{workspace}/tree/{path}?token={self.token}"

    def set_theme(self, theme: str) -> None:
        """Make ``theme`` JupyterLab's theme from the next page load on (the user's setting)."""
        self.api("PUT", "/lab/api/settings/@jupyterlab/apputils-extension:themes",
                 {"raw": json.dumps({"theme": theme})})

    def shut_down_kernels(self) -> None:
        """Free the CPU for the next test (two cores): end every session's kernel."""
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}")


@pytest.fixture(scope="session")
def chromium_executable() -> Path:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: the browser tests drive Debian's Chromium. Run the setup first: "
                    "apt-get update && apt-get install -y chromium fonts-liberation", pytrace=False)
    return CHROMIUM


@pytest.fixture(scope="session")
def built_extension() -> Path:
    built = BUILT_EXTENSION / "package.json"
    if not built.is_file():
        pytest.fail(f"The JupyterLab extension is not built ({BUILT_EXTENSION} is missing). Build it with "
                    "`pip install -e .` or scripts/build-labextension.", pytrace=False)
    sources = [p for folder in ("src", "style") for p in (REPO / "labextension" / folder).rglob("*")]
    newer = [p for p in sources if p.stat().st_mtime > built.stat().st_mtime]
    if newer:
        # Testing an old build against new sources would pass or fail for the wrong reasons.
        pytest.fail(f"{newer[0].relative_to(REPO)} changed after the extension was last built; "
                    "rebuild it with scripts/build-labextension.", pytrace=False)
    return BUILT_EXTENSION


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory: pytest.TempPathFactory, built_extension: Path) -> Iterator[LabServer]:
    home = tmp_path_factory.mktemp("jupyterlab")
    names = ("config", "data", "runtime", "settings", "workspaces", "notebooks")
    dirs = {name: home / name for name in names}
    for path in dirs.values():
        path.mkdir()
    (dirs["data"] / "labextensions").mkdir()
    (dirs["data"] / "labextensions" / "accelnb-labextension").symlink_to(built_extension)
    news = dirs["settings"] / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false"}))  # its toast would cover the panel

    token = secrets.token_hex(16)
    port = _free_port()
    env = dict(os.environ,
               JUPYTER_CONFIG_DIR=str(dirs["config"]), JUPYTER_DATA_DIR=str(dirs["data"]),
               JUPYTER_RUNTIME_DIR=str(dirs["runtime"]), JUPYTERLAB_SETTINGS_DIR=str(dirs["settings"]),
               JUPYTERLAB_WORKSPACES_DIR=str(dirs["workspaces"]),
               # The data directory above, with the working tree's build, before the venv's
               # copy that `pip install -e .` made (which would win in a venv by default, and
               # can be older than the last `jlpm build:prod`).
               JUPYTER_PREFER_ENV_PATH="0",
               ACCELNB_SYNTHETIC_GPUS=str(SYNTHETIC_GPUS),
               # Kernels import accelnb from this working tree, installed or not.
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    ARTIFACTS.mkdir(exist_ok=True)
    log_path = ARTIFACTS / "jupyterlab-server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
             f"--port={port}", f"--IdentityProvider.token={token}",
             f"--ServerApp.root_dir={dirs['notebooks']}"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
    server = LabServer(f"http://127.0.0.1:{port}", token, dirs["notebooks"], process)
    try:
        _wait_until_up(server, log_path)
        _check_it_serves(server, built_extension)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def browser(chromium_executable: Path) -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(chromium_executable), headless=True,
            # Without the networking flags Chromium keeps trying hosts this machine cannot reach.
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser, lab_server: LabServer, request: pytest.FixtureRequest) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    try:
        yield page
    finally:
        report = getattr(request.node, "report_call", None)
        if report is not None and report.failed:
            page.screenshot(path=str(ARTIFACTS / f"{request.node.name}-failure.png"))
        context.close()
        lab_server.shut_down_kernels()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_until_up(server: LabServer, log_path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            log = log_path.read_text()[-3000:]
            pytest.fail(f"JupyterLab exited with {server.process.returncode}:\n{log}")
        try:
            server.api("GET", "/api/status")
            return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)
    pytest.fail(f"JupyterLab did not answer within {timeout} s:\n{log_path.read_text()[-3000:]}")


def _check_it_serves(server: LabServer, built_extension: Path) -> None:
    """Fail unless JupyterLab loads the extension from the working tree's build."""
    request = urllib.request.Request(f"{server.url}/lab", headers={"Authorization": f"token {server.token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        page = response.read().decode()
    config_script = page.split('id="jupyter-config-data"', 1)[1].split(">", 1)[1]
    config = json.loads(config_script.split("</script>", 1)[0])
    served = {ext["name"]: ext["load"] for ext in config["federated_extensions"]}
    built = json.loads((built_extension / "package.json").read_text())["jupyterlab"]["_build"]["load"]
    if served.get("accelnb-labextension") != built:
        pytest.fail(f"JupyterLab serves accelnb-labextension from {served.get('accelnb-labextension')}, "
                    f"not the working tree's build ({built}): another copy shadows it", pytrace=False)
