"""``benchmarks/RESULTS.md`` holds one section per benchmark script; each rewrites only its own.

    replace_section("## Data in and out of a launch", text)   # text starts with that heading

A section runs from its ``## `` heading to the next one. Rerunning a benchmark replaces its
section where it was (so reruns do not pile up) and leaves every other script's section as is.
"""

from __future__ import annotations

import os

RESULTS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")


def replace_section(heading: str, text: str, path: str = RESULTS_PATH) -> None:
    """Put ``text`` (a section starting with ``heading``) in place of every section so headed."""
    try:
        with open(path) as f:
            lines = f.read().splitlines(keepends=True)
    except FileNotFoundError:
        lines = []
    sections: list[list[str]] = []
    for line in lines:
        if line.startswith("## ") or not sections:
            sections.append([])
        sections[-1].append(line)
    kept = ["".join(s).rstrip("\n") + "\n" for s in sections if not s[0].startswith(heading)]
    where = next((i for i, s in enumerate(sections) if s[0].startswith(heading)), len(kept))
    kept.insert(where, text.rstrip("\n") + "\n")
    with open(path, "w") as f:
        f.write("\n".join(kept))


def run_header(heading: str, setting: str, load_before: tuple[float, float, float], seconds: float,
               command: str) -> list[str]:
    """A section's first lines: the heading, then when, where (``setting``: the ranks, say), which
    torch, the machine's load at the start and now, and how long the run took."""
    import datetime
    import platform

    import torch

    def load(values: tuple[float, ...]) -> str:
        return "/".join(f"{x:.1f}" for x in values)

    return [
        heading, "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- machine: {os.cpu_count()} CPUs, {platform.system()} {platform.release()}; {setting}",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}",
        f"- load average (1/5/15 min) at start {load(load_before)}, at end {load(os.getloadavg())}; "
        f"whole run {seconds:.0f} s (`{command}`)",
    ]


def publish(heading: str, lines: list[str], write: bool) -> None:
    """Print a section's lines; with ``write``, also put them in place of its section of RESULTS.md."""
    text = "\n".join(lines) + "\n"
    print(text)
    if write:
        replace_section(heading, text)
