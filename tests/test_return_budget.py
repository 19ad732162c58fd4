"""What a ``%%distributed`` cell brings back: names within a size budget, never a DataLoader.

Sizes and choices are pure (``worker/return_budget.py``) and tested without processes; the
notebook flow runs in a real kernel with real ranks, including a 300 MB name that must stay on
the ranks by default.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from accelnb.kernel.display.byte_sizes import describe_limit, human_bytes, parse_byte_size
from accelnb.wire.cell_contract import DEFAULT_RETURN_LIMIT
from accelnb.worker.return_budget import (
    choose_returns,
    estimated_size,
    reason_to_keep_on_ranks,
)
from tests.conftest import error_of, run_notebook, stream_text

MB = 1_000_000


# ── sizes, without pickling ─────────────────────────────────────────────────────────────────────
def test_tensor_and_array_sizes_are_their_bytes() -> None:
    assert estimated_size(torch.zeros(1000, dtype=torch.float32)) == 4000
    assert estimated_size(np.zeros(1000, dtype=np.float64)) == 8000


def test_a_view_costs_its_whole_storage_once() -> None:
    base = torch.zeros(1000)
    # pickling a view sends its whole storage; two views of one storage send it once
    assert estimated_size(base[:10]) == 4000
    assert estimated_size([base[:10], base[10:20], base]) == 4000 + 8 * 3


def test_a_model_and_its_optimizer_count_the_parameters_once() -> None:
    model = torch.nn.Linear(1000, 1000)
    weights = 4 * (1000 * 1000 + 1000)
    assert weights <= estimated_size(model) < weights + 100_000
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 1000)).sum().backward()
    optimizer.step()  # Adam keeps two tensors per parameter: 2x the weights in state
    both = estimated_size({"model": model, "optimizer": optimizer})
    assert 3 * weights <= both < 3 * weights + 200_000


def test_loaders_samplers_and_fsdp_models_make_no_sense_in_the_notebook() -> None:
    data = torch.utils.data.TensorDataset(torch.zeros(4, 1))
    assert "DataLoader" in (reason_to_keep_on_ranks(torch.utils.data.DataLoader(data)) or "")
    assert "sampler" in (reason_to_keep_on_ranks(torch.utils.data.RandomSampler(data)) or "")
    assert reason_to_keep_on_ranks(torch.nn.Linear(1, 1)) is None
    assert reason_to_keep_on_ranks(data) is None


def test_the_biggest_names_stay_on_the_ranks_past_the_budget() -> None:
    namespace = {"a": torch.zeros(25 * MB // 4), "b": torch.zeros(50 * MB // 4), "c": torch.zeros(100 * MB // 4),
                 "loader": torch.utils.data.DataLoader([1, 2]), "n": 3}
    choice = choose_returns(namespace, ["c", "n", "loader", "a", "b"], explicit=False, limit=80 * MB)
    assert choice.send == ["n", "a", "b"]  # in the cell's order
    assert choice.kept_for_size == {"c": 100 * MB}
    assert list(choice.kept_for_kind) == ["loader"]


def test_named_returns_come_back_whatever_their_size_or_kind() -> None:
    namespace = {"c": torch.zeros(100 * MB // 4), "loader": torch.utils.data.DataLoader([1, 2])}
    choice = choose_returns(namespace, ["c", "loader"], explicit=True, limit=1)
    assert choice.send == ["c", "loader"] and not choice.kept_for_size and not choice.kept_for_kind


def test_no_budget_brings_everything_back() -> None:
    choice = choose_returns({"c": torch.zeros(100 * MB // 4)}, ["c"], explicit=False, limit=None)
    assert choice.send == ["c"]


def test_sizes_read_and_written_as_people_do() -> None:
    assert parse_byte_size("256MB") == 256 * MB
    assert parse_byte_size("1.5 GiB") == 3 * 2**29
    assert parse_byte_size("1000") == 1000
    assert human_bytes(300 * MB) == "300.0 MB"
    assert describe_limit(DEFAULT_RETURN_LIMIT) == "256 MiB"
    with pytest.raises(ValueError, match="256MB"):
        parse_byte_size("lots")


# ── in a real kernel ────────────────────────────────────────────────────────────────────────────
CELLS = {
    "load": "%load_ext accelnb",
    "assign": ("%%distributed --procs 2 --cpu\n"
               "import torch\n"
               "big = torch.ones(300_000_000 // 4)\n"
               "small = torch.arange(3) + rank\n"
               "loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)\n"
               "steps = 7"),
    "check": "print('big' in globals(), 'loader' in globals(), small.tolist(), steps)",
    "limit": ("%%distributed --procs 2 --cpu --return-limit 1MB\n"
              "import torch\nmid = torch.ones(500_000)\n"
              "tiny = 1"),
    "named": ("%%distributed --procs 2 --cpu --return-limit 1MB --return mid\n"
              "import torch\nmid = torch.full((500_000,), 2.0)"),
    "check_named": "print(float(mid.sum()), 'tiny' in globals())",
    "bad_limit": "%%distributed --procs 2 --cpu --return-limit lots\nx = 1",
}


@pytest.fixture(scope="module")
def outputs() -> dict[str, Any]:
    return dict(zip(CELLS, run_notebook(list(CELLS.values())), strict=True))


def test_a_300_mb_name_stays_on_the_ranks_and_the_cell_says_how_to_get_it(outputs: dict[str, Any]) -> None:
    text = stream_text(outputs["assign"])
    assert "accelnb: brought back from rank 0: small, steps" in text
    assert "kept on the ranks, over the 256 MiB return budget (--return-limit): big (300.0 MB)" in text
    assert "`%%distributed --return big` brings it back whatever its size" in text
    assert "a persistent session (%distributed start) would keep it on the ranks" in text
    assert "not brought back: loader (a DataLoader:" in text
    assert stream_text(outputs["check"]).strip() == "False False [0, 1, 2] 7"


def test_return_limit_and_named_returns(outputs: dict[str, Any]) -> None:
    text = stream_text(outputs["limit"])
    assert "brought back from rank 0: tiny" in text
    assert "over the 1.0 MB return budget (--return-limit): mid (2.0 MB)" in text
    assert "brought back from rank 0: mid" in stream_text(outputs["named"])
    assert stream_text(outputs["check_named"]).strip() == "1000000.0 True"


def test_a_bad_return_limit_is_a_usage_error(outputs: dict[str, Any]) -> None:
    said = stream_text(outputs["bad_limit"], "stderr")  # IPython prints a magic's UsageError, no traceback
    assert "UsageError: --return-limit: 'lots' is not a size; write it like 256MB" in said
    assert error_of(outputs["bad_limit"]) is None
