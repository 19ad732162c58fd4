"""What a ``%%distributed`` cell reads and assigns (``wire/cell_analysis.py``): the names the
magic ships to the ranks and brings back, on the constructs cells are written with."""

from __future__ import annotations

import ast

import pytest

from accelnb.wire.cell_analysis import assigned_names, names_bound_by, used_names

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
    assert assigned_names(CELLS["training loop"]) == ["model", "epoch", "loss"]
    assert assigned_names(CELLS["functions and comprehensions"]) == ["train", "scale"]
    assert assigned_names("import os\nfrom x import y\n(z := 3)\nclass K: attr = 1") == ["z", "K"]


@pytest.mark.parametrize("source", CELLS.values(), ids=CELLS.keys())
def test_a_rank_finds_the_same_names_in_the_tree_it_runs(source: str) -> None:
    """A rank parses the cell once, shifted a line down (the magic's line), and reads the names
    from that tree."""
    tree = ast.parse("\n" + source, "<cell In[1]>")
    assert names_bound_by(tree.body) == assigned_names(source)
