"""Reading a ``%%distributed`` cell's source: which notebook names it uses, which it assigns.

Pure functions over the AST, so they are cheap and testable without a kernel::

    >>> sorted(used_names("model.fit(data)\\nresult = model.score"))
    ['data', 'model']
    >>> assigned_names("import os\\nx = 1\\nfor i in range(3): y = i\\ndef f(): z = 2")
    ['x', 'i', 'y', 'f']
"""

from __future__ import annotations

import ast
import functools


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


def assigned_names(source: str) -> list[str]:
    """Names bound at the cell's top level, in order, excluding imports (modules stay home)."""
    return names_bound_by(_parsed(source).body)


def names_bound_by(statements: list[ast.stmt]) -> list[str]:
    """:func:`assigned_names` of a tree parsed already (a rank parses the cell to run it)."""
    names: dict[str, None] = {}
    for statement in statements:
        for name in _bound_by(statement):
            names.setdefault(name)
    return list(names)


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
