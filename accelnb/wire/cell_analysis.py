"""Reading a ``%%distributed`` cell's source: which notebook names it uses, which it assigns, and
where its value is.

The kernel reads the cell, once, and the ranks are told what it found (``wire/cell_contract.py``):
they compile the source as it is and build no syntax tree of their own (for the 26-line cell of
``benchmarks/bench_session_cell.py``, parsing into Python's ``ast`` objects and compiling those took
360 µs a rank, hot, compiling the text 170).
A cell Python cannot parse raises ``SyntaxError`` here, in the kernel, before any rank runs it.

Pure functions over the AST, so they are cheap and testable without a kernel::

    >>> sorted(used_names("model.fit(data)\\nresult = model.score"))
    ['data', 'model']
    >>> assigned_names("import os\\nx = 1\\nfor i in range(3): y = i\\ndef f(): z = 2")
    ('x', 'i', 'y', 'f')
    >>> last_expression("x = 1\\nx + 1")
    LastExpression(start=6, end=11, line=2, column=0)
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass

from accelnb.wire.buffers import plain_record

# What ends a line for Python's tokenizer (which numbers the lines the tree's positions count), not
# ``str.splitlines``'s longer list (a form feed or U+2028 inside a line would shift every line after).
_LINE_END = re.compile(r"\r\n|\r|\n")


@plain_record
@dataclass(frozen=True)
class LastExpression:
    """The cell's last top-level statement, when it is an expression: its value is the cell's value.

    ``start``/``end``: where its text is in the source, in characters (a ``;`` after it, and
    comments, left out); ``line``: its first line, 1 for the source's first; ``column``: where it
    starts on that line, in UTF-8 bytes, as Python counts columns in positions and tracebacks.
    """

    start: int
    end: int
    line: int
    column: int

    def text_to_eval(self, source: str, lines_before: int = 0) -> str:
        """The expression's text, placed at its own line and column (the source has
        ``lines_before`` more lines above it where it runs), so that a traceback from it shows the
        cell's line with the carets under the expression.

        In parentheses, which change no expression's meaning but make one that only a statement
        may be (``*a, b``) one that ``eval`` takes, and in which the spaces before it are no
        indentation. The opening one goes before it on its line, or on the line above."""
        text = source[self.start:self.end]
        above = self.line - 1 + lines_before
        if self.column:
            return "\n" * above + "(" + " " * (self.column - 1) + text + ")"
        if above:
            return "\n" * (above - 1) + "(\n" + text + ")"
        return "(" + text + ")"  # nothing above the source's first line: one column off in a traceback


def runnable_parts(source: str, last: LastExpression | None, lines_before: int = 0) -> tuple[str, str | None]:
    """How a cell runs: the text of the statements before its value, to ``exec``, and the text of
    its value's expression, to ``eval`` after them (None: the cell has no value), both placed at
    the cell's own lines, under ``lines_before`` more (the magic's line)."""
    above = "\n" * lines_before
    if last is None:
        return above + source, None
    return above + source[:last.start], last.text_to_eval(source, lines_before)


@functools.lru_cache(maxsize=8)
def _parsed(source: str) -> ast.Module:
    """The cell's tree, parsed once for the several questions a cell's run asks of it (read only)."""
    return ast.parse(source)


@functools.lru_cache(maxsize=8)
def used_names(source: str) -> frozenset[str]:
    """Every name the cell reads anywhere, functions and comprehensions included.

    A cell's run asks twice (the names to ship, the modules to import), and a cell is often run
    again: remembered per source. A walk of our own, not ``ast.walk``: 32 µs against 124 for a
    31-line cell (``ast.walk`` makes a generator per node)."""
    found: set[str] = set()
    pending: list[object] = [_parsed(source)]
    while pending:
        node = pending.pop()
        if type(node) is ast.Name:
            if type(node.ctx) is ast.Load:
                found.add(node.id)
            continue
        if not isinstance(node, ast.AST):  # a str of a list field (global's names, a match's attributes)
            continue
        for field in node._fields:
            value = getattr(node, field, None)
            if type(value) is list:
                pending.extend(value)
            elif isinstance(value, ast.AST):
                pending.append(value)
    return frozenset(found)


@functools.lru_cache(maxsize=8)
def assigned_names(source: str) -> tuple[str, ...]:
    """Names bound at the cell's top level, in order, excluding imports (modules stay home)."""
    names: dict[str, None] = {}
    for statement in _parsed(source).body:
        for name in _bound_by(statement):
            names.setdefault(name)
    return tuple(names)


def syntax_error(source: str, filename: str, lines_before: int = 0) -> SyntaxError | None:
    """What Python reports of a ``source`` it cannot parse, placed ``lines_before`` lines down in
    ``filename`` (the notebook's cell, under its magic's line): the error's line and those its
    message names ("after 'for' statement on line 2") are the cell's. None when it parses."""
    try:
        ast.parse("\n" * lines_before + source, filename)
    except SyntaxError as error:
        return error
    return None


@functools.lru_cache(maxsize=8)
def last_expression(source: str) -> LastExpression | None:
    """Where the cell's value is: its last top-level statement, when that is an expression not
    followed by a ``;`` (which, as in a plain cell, says "no value": the expression still runs, as
    a statement). None otherwise."""
    body = _parsed(source).body
    if not body or not isinstance(body[-1], ast.Expr):
        return None
    last = body[-1]
    assert last.end_lineno is not None and last.end_col_offset is not None  # a parsed tree has them
    starts = [0, *(match.end() for match in _LINE_END.finditer(source))]
    end = _offset(source, starts, last.end_lineno, last.end_col_offset)
    if source[end:].lstrip(" \t\f\r\n").startswith(";"):  # only a ";", comments and blanks follow the last statement
        return None
    return LastExpression(start=_offset(source, starts, last.lineno, last.col_offset), end=end,
                          line=last.lineno, column=last.col_offset)


def _offset(source: str, line_starts: list[int], line: int, column: int) -> int:
    """The character offset of a tree position (its line, 1 first; its column in UTF-8 bytes)."""
    start = line_starts[line - 1]
    text = source[start:start + column]  # at least ``column`` bytes: each character is one or more
    if not text.isascii():
        text = text.encode("utf-8", "surrogatepass")[:column].decode("utf-8", "surrogatepass")
    return start + len(text)


def _bound_by(statement: ast.stmt) -> list[str]:
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [statement.name]
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return []
    names: list[str] = []
    nested_scopes = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda,
                     ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
    stack: list[ast.AST] = [statement]
    while stack:
        node = stack.pop(0)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.append(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not statement:
            names.append(node.name)
            continue
        if isinstance(node, nested_scopes) and node is not statement:
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        stack.extend(ast.iter_child_nodes(node))
    return names
