"""What a ``%%distributed`` cell reads and assigns (``wire/cell_analysis.py``): the names the
magic ships to the ranks and brings back, on the constructs cells are written with; and where its
last expression is, which a rank runs from the text alone, at the cell's own lines and columns."""

from __future__ import annotations

import ast
import linecache
import traceback
from collections.abc import Callable

import pytest

from accelnb.wire.cell_analysis import assigned_names, last_expression, runnable_parts, syntax_error, used_names

CELLS = {
    "training loop": (
        "model = build(config)\n"
        "for epoch in range(epochs):\n"
        "    loss = step(model, batch_size=bs)\n"
        "    print(f'{epoch}: {loss:.{digits}f}')\n"),
    "functions and comprehensions": (
        "def train(lr=default_lr, *args, **kw):\n"
        "    global seen\n"
        "    return [w * lr for w in weights if w > floor]\n"
        "scale = lambda x, k=factor: x * k\n"),
    "match, async, walrus": (
        "match event:\n"
        "    case Point(x=a, y=b) if a > limit: print(a, b)\n"
        "    case {'kind': kind, **rest}: handle(rest)\n"
        "async def fetch():\n"
        "    async with session_factory() as s:\n"
        "        return [r async for r in s.stream(url)]\n"
        "if (n := len(items)) > cap: del items[0]\n"),
    "classes and annotations": (
        "class Net(torch.nn.Module):\n"
        "    size: Width = default_width\n"
        "    def forward(self, x: Tensor) -> Tensor:\n"
        "        return self.layer(x)\n"),
}


def reference_used_names(source: str) -> set[str]:
    """The plain definition: every ``Name`` in a load context, by ``ast.walk``."""
    return {node.id for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}


@pytest.mark.parametrize("source", CELLS.values(), ids=CELLS.keys())
def test_used_names_are_every_name_read_anywhere(source: str) -> None:
    assert used_names(source) == reference_used_names(source)
    assert used_names(source) is used_names(source)  # remembered: asked twice per cell, and per rerun


def test_used_names_of_a_training_loop() -> None:
    assert used_names(CELLS["training loop"]) == {
        "build", "config", "range", "epochs", "step", "model", "bs", "print", "epoch", "loss", "digits"}


def test_names_only_stored_or_attributes_are_not_read() -> None:
    names = used_names("a = 1\nb.c = 2\ndel d\nfor e in f: pass\nimport g\nh.i.j(k)")
    assert names == {"b", "f", "h", "k"}  # an attribute's object is read; del d reads nothing


def test_assigned_names_are_the_top_level_ones_in_order() -> None:
    assert assigned_names(CELLS["training loop"]) == ("model", "epoch", "loss")
    assert assigned_names(CELLS["functions and comprehensions"]) == ("train", "scale")
    assert assigned_names("import os\nfrom x import y\n(z := 3)\nclass K: attr = 1") == ("z", "K")


# The cell's value as a rank computed it from its own tree until the kernel read it for the ranks.
def value_by_the_tree(source: str, namespace: dict[str, object]) -> object:
    tree = ast.parse(source)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<cell>", "exec"), namespace)
    return eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace) if last else None


def value_by_the_text(source: str, namespace: dict[str, object]) -> object:
    """As a rank runs it now (``worker/cell_runner.py``): the statements, then the expression's text."""
    statements, expression = runnable_parts(source, last_expression(source))
    exec(compile(statements, "<cell>", "exec"), namespace)
    return eval(compile(expression, "<cell>", "eval"), namespace) if expression is not None else None


ENDINGS = {
    "an expression": "x = 2\nx * 3",
    "after a semicolon, then a comment": "x = 2; (x *\n 3)  # the value; not the end",
    "parenthesised over lines": "x = 2\n(x +\n    # a comment inside\n  1)",
    "a starred tuple": "a, b = 1, 2\n*[a], b",
    "after non-ASCII text on its line": "é = 2; é * 5",
    "Windows line ends": "x = 2\r\ny = 3\r\nx * y",
    "a form feed inside a line": "x = 2\f\n# \f\nx + 1",
    "a lambda, a walrus, a conditional": "f = lambda v: v + 1\n(n := f(1)) if True else 0",
    "an assignment": "x = 2",
    "a for loop": "for i in range(3):\n    i",
    "nothing but an expression": "41 + 1",
    "empty": "",
}


@pytest.mark.parametrize("source", ENDINGS.values(), ids=ENDINGS.keys())
def test_the_text_gives_the_value_the_tree_gave(source: str) -> None:
    assert value_by_the_text(source, {}) == value_by_the_tree(source, {})
    assert last_expression(source) is last_expression(source)  # remembered, as a cell is often run again


@pytest.mark.parametrize("source", [
    "x = 0\n1 / x", "x = 0; 1 / x", "é = 0; 1 / é", "x = 0\n(2 +\n   1 / x)", "x = 0\n1 / x  # the value",
])
def test_a_failing_expression_is_shown_at_its_line_and_column(source: str) -> None:
    """The traceback of the cell's last expression shows what the tree's code showed: the cell's
    line (one below the magic's) and the carets under the failing part, however its line begins."""
    filename = "<cell In[7]>"
    linecache.cache[filename] = (0, None, ["%%distributed\n", *source.splitlines(keepends=True)], filename)

    def shown(run: Callable[[], object]) -> list[str]:
        with pytest.raises(ZeroDivisionError) as raised:
            run()
        return traceback.format_exception(raised.value)[-2].splitlines()

    tree = ast.parse("\n" + source, filename)
    by_the_tree = shown(lambda: eval(compile(ast.Expression(tree.body[-1].value), filename, "eval"), {"x": 0, "é": 0}))
    _, expression = runnable_parts(source, last_expression(source), lines_before=1)
    assert expression is not None
    by_the_text = shown(lambda: eval(compile(expression, filename, "eval"), {"x": 0, "é": 0}))
    assert by_the_text == by_the_tree
    assert "~^~" in by_the_text[-1]  # and the carets are there to compare


def test_a_cell_python_cannot_parse_raises_in_the_kernel() -> None:
    with pytest.raises(SyntaxError) as raised:
        last_expression("x = 1\ny = (")
    assert raised.value.lineno == 2


def test_a_syntax_error_is_reported_for_the_cell_as_the_notebook_shows_it() -> None:
    """Below the magic's line: the error's line, and the line its message names, are the cell's."""
    error = syntax_error("for i in x:\nprint(i)", "<cell In[4]>", lines_before=1)
    assert error is not None and (error.filename, error.lineno, error.text) == ("<cell In[4]>", 3, "print(i)\n")
    assert error.msg == "expected an indented block after 'for' statement on line 2"
    assert syntax_error("x = 1", "<cell In[4]>", lines_before=1) is None


def test_a_semicolon_after_the_last_expression_means_no_value_as_in_a_plain_cell() -> None:
    """IPython shows no ``Out`` for a cell that ends with ``;``; the expression still runs."""
    for source in ("x = 2\nx * 3;", "x = 2\nx * 3 ;  # no value", "x = 2\n(x *\n 3)\t;\n\n# done"):
        assert last_expression(source) is None
        assert value_by_the_text(source, {}) is None
    ran: list[int] = []
    value_by_the_text("ran.append(1);", {"ran": ran})
    assert ran == [1]
