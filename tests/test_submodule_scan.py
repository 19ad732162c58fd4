"""accelnb's scan for the submodules a function reaches stands in for cloudpickle's private one
(``wire/submodule_scan.py``): it must still be cloudpickle's name, give what cloudpickle's gives,
and a function pickled with it must run where the submodule was never imported."""

from __future__ import annotations

import concurrent.futures
import email.mime.text
import os.path
import subprocess
import sys
import xml.etree.ElementTree

import cloudpickle
import cloudpickle.cloudpickle as cloudpickle_internals
import torch
import torch.nn.functional

from accelnb.wire import buffers, submodule_scan


def uses_submodules_through_packages(x: torch.Tensor) -> object:
    return (torch.nn.functional.relu(x), concurrent.futures.ThreadPoolExecutor, xml.etree.ElementTree.Element,
            email.mime.text.MIMEText, os.path.join)


def uses_only_the_package(x: torch.Tensor) -> torch.Tensor:
    return torch.ones(1) + x


def test_it_stands_in_for_cloudpickles_own_scan() -> None:
    """The name cloudpickle calls is still there (a release that renames it fails here, rather
    than leaving every launch 2.6 ms slower unseen), and accelnb's scan is what it calls once the
    data plane (``wire/buffers.py``, imported above) is."""
    assert submodule_scan.CLOUDPICKLES_SCAN is not None, \
        f"cloudpickle {cloudpickle.__version__} has no _find_imported_submodules: see wire/submodule_scan.py"
    assert cloudpickle_internals._find_imported_submodules is submodule_scan.find_imported_submodules


def test_it_finds_what_cloudpickles_scan_finds() -> None:
    import email  # a package among the function's globals, like the others
    import xml

    for function in (uses_submodules_through_packages, uses_only_the_package):
        dependencies = [torch, concurrent, xml, email, os, sys, function.__globals__["torch"]]
        ours = submodule_scan.find_imported_submodules(function.__code__, dependencies)
        theirs = submodule_scan.CLOUDPICKLES_SCAN(function.__code__, dependencies)  # type: ignore[misc]
        assert sorted(m.__name__ for m in ours) == sorted(m.__name__ for m in theirs)
    found = {m.__name__ for m in submodule_scan.find_imported_submodules(
        uses_submodules_through_packages.__code__, [torch, concurrent, xml, email])}
    assert {"torch.nn", "torch.nn.functional", "concurrent.futures", "xml.etree", "xml.etree.ElementTree",
            "email.mime", "email.mime.text"} <= found
    assert not submodule_scan.find_imported_submodules(uses_only_the_package.__code__, [torch])


def test_a_function_sent_by_value_imports_the_submodules_it_reaches() -> None:
    """Pickled here, run in a fresh interpreter that imported none of them: unpickling imports
    what the function reaches through ``concurrent`` and ``xml``."""
    source = ("import concurrent, xml\n"
              "def reach():\n"
              "    return concurrent.futures.ThreadPoolExecutor.__name__, xml.etree.ElementTree.tostring.__name__\n")
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec(compile(source, "<cell In[1]>", "exec"), namespace)
    packed = buffers.dump(namespace["reach"])
    assert not packed.buffers
    check = ("import pickle, sys\n"
             "assert 'concurrent.futures' not in sys.modules and 'xml.etree' not in sys.modules\n"
             "print(pickle.loads(sys.stdin.buffer.read())())\n")
    done = subprocess.run([sys.executable, "-c", check], input=packed.body, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "('ThreadPoolExecutor', 'tostring')"
