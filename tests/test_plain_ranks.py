"""A rank forked from the kernel looks like a plain Python process (``worker/other_launchers/plain_process.py``).

A real kernel that did what Hugging Face notebooks do first (import torch, tqdm.auto and
transformers, ask transformers whether it runs in a notebook, ``logging.basicConfig``) launches
2 CPU ranks forked from it. In each rank: ``get_ipython()`` is None, there is no ``sys.ps1``,
``tqdm.auto`` gives the console bar, not the widget, transformers' ``is_in_notebook()`` says no, and the rank's
log records reach the cell with not one ``--- Logging error ---`` nor "send message from fork".
The same cells with ``ACCELNB_HELPER_START=spawn`` (ranks never forked from the kernel) give the
same answers: the two ways of starting ranks cannot be told apart.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import error_of, run_notebook, stream_text

NOTEBOOK_FIRST_CELL = """
import logging, sys, json
import torch, accelnb
import tqdm.auto
import transformers
from transformers.utils import is_in_notebook
logging.basicConfig(level=logging.INFO, force=True)
transformers.logging.set_verbosity_info()
import tqdm.notebook
print(json.dumps({"kernel_in_notebook": is_in_notebook(),
                  "kernel_widget_bar": issubclass(tqdm.auto.tqdm, tqdm.notebook.tqdm)}))
"""

LAUNCH_CELL = """
def looks_plain():
    import logging, sys
    import IPython
    from tqdm.auto import tqdm
    from tqdm.notebook import tqdm as widget_bar
    from transformers.utils import is_in_notebook
    logging.getLogger("rank.code").warning("a warning from the rank")
    transformers.logging.get_logger("transformers.trainer").info("an info line from transformers")
    for _ in tqdm(range(3), desc="steps"):
        pass
    return {"get_ipython": IPython.get_ipython() is None, "ps1": hasattr(sys, "ps1"),
            "widget_bar": issubclass(tqdm, widget_bar), "in_notebook": is_in_notebook()}

values = accelnb.launch(looks_plain, num_processes=2, quiet=True, collect="all").values
print(json.dumps(values[0]), json.dumps(values[1]))
"""


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_rank_looks_like_plain_python(start: str) -> None:
    outputs = run_notebook([NOTEBOOK_FIRST_CELL, LAUNCH_CELL], env={"ACCELNB_HELPER_START": start})
    assert error_of(outputs[0]) is None and error_of(outputs[1]) is None, outputs
    kernel = json.loads(stream_text(outputs[0]).strip().splitlines()[-1])
    assert kernel == {"kernel_in_notebook": True, "kernel_widget_bar": True}  # the kernel is a notebook
    shown = stream_text(outputs[1]) + stream_text(outputs[1], "stderr")
    ranks = [json.loads(part) for part in stream_text(outputs[1]).strip().splitlines()[-1].split("} ")
             for part in [part if part.endswith("}") else part + "}"]]
    plain = {"get_ipython": True, "ps1": False, "widget_bar": False, "in_notebook": False}
    assert ranks == [plain, plain], shown
    assert "a warning from the rank" in shown
    assert "--- Logging error ---" not in shown and "from fork" not in shown, shown
    print(f"{start}: cell output {len(shown)} characters")
