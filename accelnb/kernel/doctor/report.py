"""What the doctor found, as data and as a table: :class:`Check` records in a :class:`DoctorReport`.

Checking (:mod:`accelnb.kernel.doctor.checks`) never renders; this module never looks at the machine.

    >>> report = DoctorReport([Check("open files", "warn", "soft limit 1024", "ulimit -n 65536")])
    >>> report.worst
    'warn'
    >>> print(report)                                                      # doctest: +NORMALIZE_WHITESPACE
    accelnb doctor: 0 ok, 1 warn, 0 fail
    warn  open files  soft limit 1024
                      fix: ulimit -n 65536
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["ok", "warn", "fail"]
_SEVERITY: dict[Status, int] = {"ok": 0, "warn": 1, "fail": 2}


@dataclass(frozen=True)
class Check:
    """One finding: what was checked, how it stands, what was seen, and how to fix it."""

    name: str
    status: Status
    detail: str
    fix: str = ""  # empty when there is nothing to do


class DoctorReport(list[Check]):
    """Every check of one doctor run, in order. Prints as a plain-text table."""

    def count(self, status: Status) -> int:  # type: ignore[override]
        return sum(1 for check in self if check.status == status)

    @property
    def worst(self) -> Status:
        return max((check.status for check in self), key=_SEVERITY.__getitem__, default="ok")

    def by_name(self, name: str) -> Check:
        found = next((check for check in self if check.name == name), None)
        if found is None:
            raise KeyError(f"no check named {name!r}; there are {[c.name for c in self]}")
        return found

    def summary(self) -> str:
        return f"accelnb doctor: {self.count('ok')} ok, {self.count('warn')} warn, {self.count('fail')} fail"

    def __str__(self) -> str:
        width = max((len(check.name) for check in self), default=0)
        lines = [self.summary()]
        for check in self:
            lines.append(f"{check.status:<4}  {check.name:<{width}}  {check.detail}")
            if check.fix:
                lines.append(f"{'':<4}  {'':<{width}}  fix: {check.fix}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        # doctor() has printed the table already; a notebook showing the value repeats only this.
        return f"<{self.summary()}>"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))

    def html_table(self) -> str:
        """The table as HTML, for displays that want one (a panel)."""
        rows = "".join(
            f"<tr><td>{check.status}</td><td>{html.escape(check.name)}</td>"
            f"<td>{html.escape(check.detail)}</td><td>{html.escape(check.fix)}</td></tr>"
            for check in self)
        return (f"<table><caption>{html.escape(self.summary())}</caption>"
                f"<tr><th>status</th><th>check</th><th>seen</th><th>fix</th></tr>{rows}</table>")
