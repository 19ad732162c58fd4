"""``wire/buffers.dump``'s direct path for plain data, and what keeps a value off it.

A session cell's call and answer are plain data (strings, numbers, accelnb's own records of them)
and are pickled by the C pickler alone; anything else (a tensor, a function, a subclass, a
record holding either) must still go through cloudpickle and the tensor reduction, with big
buffers out of band. Each test rebuilds the value as a rank or the kernel would.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from accelnb.wire.buffers import PLAIN_CHECK_LIMIT, Packed, dump, load
from accelnb.wire.cell_contract import RUN_CELL, CellOutcome, CellRequest


def cell_request(**names: Any) -> CellRequest:
    return CellRequest.read("x = lr * 2", filename="<cell In[3]>", header="%%distributed", names=names,
                            modules={}, return_names=None)


class Tag(str):
    """A str subclass: pickle writes it by its class, so it is not plain."""


@dataclass
class NotARecord:
    """A dataclass accelnb did not register: its instances take cloudpickle's path."""

    value: Any


@pytest.mark.parametrize("value", [
    None, True, 3, 2.5, 1j, "text", b"bytes",
    (1, "a", None), [1, [2, [3]]], {"a": {1: (2.0, b"x")}}, {1, 2}, frozenset({"a"}),
    (RUN_CELL, (cell_request(lr=0.1, steps=[1, 2]),), {}),
], ids=repr)
def test_plain_values_pickle_as_the_c_pickler_writes_them(value: Any) -> None:
    packed = dump(value)
    assert packed.buffers == []
    assert packed.body == pickle.dumps(value, protocol=5)
    assert load(packed) == value


def test_a_cell_outcome_with_plain_values_comes_back_whole() -> None:
    outcome = CellOutcome(returned={"x": dump(1), "name": dump("rank 0")}, not_returned={"m": "too big"})
    rebuilt = load(dump(outcome))
    assert rebuilt == outcome
    assert {name: load(data) for name, data in rebuilt.returned.items()} == {"x": 1, "name": "rank 0"}


def test_a_tensor_anywhere_keeps_its_bytes_out_of_band() -> None:
    weights = torch.arange(8.0)
    for value in ({"w": weights}, [1, (2, weights)], cell_request(w=weights)):
        packed = dump(value)
        assert len(packed.buffers) == 1  # not copied into the pickle
    outcome = CellOutcome(returned={"w": dump(weights)})  # a packed value's own buffers, too
    packed = dump(outcome)
    assert len(packed.buffers) == 1
    assert torch.equal(load(load(packed).returned["w"]), weights)


def test_functions_subclasses_and_unknown_records_take_cloudpickles_path() -> None:
    rebuilt = load(dump({"f": lambda x: x + 1}))
    assert rebuilt["f"](1) == 2
    request = load(dump(cell_request(scale=lambda x: x * 3)))
    assert request.names["scale"](2) == 6
    tag = load(dump([Tag("kept")]))[0]
    assert type(tag) is Tag and tag == "kept"
    assert load(dump(NotARecord(lambda: 5))).value() == 5


def test_cycles_and_values_past_the_check_limit_still_pickle() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    rebuilt = load(dump(loop))
    assert rebuilt[1] is rebuilt
    wide = {str(index): [index] for index in range(PLAIN_CHECK_LIMIT * 2)}
    assert load(dump(wide)) == wide
    long = list(range(1_000_000))  # past the limit by its length alone: never walked
    assert load(dump([long, {"n": long}])) == [long, {"n": long}]


def test_a_packed_value_with_buffers_is_never_copied_in_band() -> None:
    inner = dump(torch.ones(4))
    assert len(inner.buffers) == 1
    outer = dump({"inner": inner})
    assert len(outer.buffers) == 1
    assert isinstance(load(outer)["inner"], Packed)
