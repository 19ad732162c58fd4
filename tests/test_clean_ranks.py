"""No rank is a fork of the kernel, whichever way in (issue 33), in notebooks run as users run them.

The first cell does what Hugging Face notebooks do first: import torch, transformers and tqdm.auto
(which picks the notebook's widget bar), configure logging, and ``import accelnb``. It also puts a
module in ``sys.modules`` that exists only in the kernel's memory, and imports a module written in
pytorch/examples' style (``from torch.distributed import init_process_group`` at import). Launches
come in later cells, through every way in: ``notebook_launcher``, ``launch`` with a 64 MiB tensor,
``%%distributed``, a session, ``sweep``, ``spawn`` and a launch after the template was killed. In
every rank: the kernel-only module is absent, ``get_ipython()`` is None, there is no ``sys.ps1``,
``tqdm.auto`` is the console bar, transformers' ``is_in_notebook()`` says no, the rank's parent is
accelnb's template program; no cell shows "send message from fork", ``--- Logging error ---`` or a
display object's repr. The Hugging Face Trainer runs with its default progress callback.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import error_of, run_notebook, stream_text

FIRST_CELL = """
import json, logging, os, sys, types
import torch
import transformers
from tqdm.auto import tqdm
from tqdm.notebook import tqdm as widget_bar
import accelnb
from tests.ddp_series_style import train as ddp_series_train
logging.basicConfig(level=logging.INFO, force=True)
sys.modules["kernel_only"] = types.ModuleType("kernel_only")
print(json.dumps({"kernel_widget_bar": issubclass(tqdm, widget_bar),
                  "kernel_in_notebook": transformers.utils.is_in_notebook()}))

def facts(*ignored):
    import logging, os, sys
    preloaded = "transformers.trainer" in sys.modules
    import IPython, psutil
    from tqdm.auto import tqdm
    from tqdm.notebook import tqdm as widget_bar
    from transformers.utils import is_in_notebook
    logging.getLogger("rank.code").warning("a warning from the rank")
    for _ in tqdm(range(3), desc="steps"):
        pass
    parent = " ".join(psutil.Process(os.getppid()).cmdline())
    return {"kernel_only": "kernel_only" in sys.modules, "get_ipython": IPython.get_ipython(),
            "ps1": hasattr(sys, "ps1"), "widget_bar": issubclass(tqdm, widget_bar),
            "in_notebook": is_in_notebook(), "from_template": "-m accelnb.worker.template.helper" in parent,
            "preloaded": preloaded}
"""
PLAIN = {"kernel_only": False, "get_ipython": None, "ps1": False, "widget_bar": False, "in_notebook": False,
         "from_template": True, "preloaded": True}

WAYS_IN = {
    "warm by the next cell": "from accelnb.kernel.helper.template import running_helper_pid\n"
                             "print(json.dumps([running_helper_pid() is not None]))",
    "notebook_launcher": "import transformers.trainer\n"
                         "print(json.dumps([accelnb.notebook_launcher(facts, num_processes=2, cpu=True)]))",
    "launch with 64 MiB": "values = accelnb.launch(facts, (torch.ones(16 << 20),), num_processes=2, cpu=True).values\n"
                          "print(json.dumps(list(values.values())))",
    "%%distributed": "%load_ext accelnb",
    "%%distributed cell": "%%distributed --procs 2 --cpu\nprint(json.dumps([facts()]))",
    "session": "with accelnb.Session.start(num_processes=2, cpu=True) as session:\n"
               "    print(json.dumps(list(session.run(facts).values.values())))",
    "sweep": "trials = accelnb.sweep(facts, [1, 2], num_processes=1, cpu=True)\n"
             "print(json.dumps([trial.value for trial in trials]))",
    "spawn": "print(json.dumps(accelnb.spawn(facts, nprocs=2, cpu=True)))",
    # Killed, then launched once it is gone (its socket closed), as a user's kill of it would be:
    # a launch in the same millisecond may still find it dying and raise HelperDied.
    "after the template was killed": "import psutil\nkilled = psutil.Process(running_helper_pid())\nkilled.kill()\n"
                                     "psutil.wait_procs([killed], timeout=10)\n"
                                     "print(json.dumps([accelnb.notebook_launcher(facts, num_processes=2, cpu=True)]))",
    "pytorch/examples style": "print(json.dumps([accelnb.notebook_launcher(ddp_series_train, (2,), num_processes=2, "
                              "cpu=True)]))",
}
FOLLOWING = {"ACCELNB_TEMPLATE": "on"}  # as for users (the suite's own kernels have bare templates: conftest)
NOISE = ("from fork", "--- Logging error ---", "<IPython.core.display", "Widget(")


def test_every_way_in_gives_ranks_that_never_were_the_kernel() -> None:
    outputs = run_notebook([FIRST_CELL, *WAYS_IN.values()], timeout=300, env=FOLLOWING)
    for name, cell in zip(["first cell", *WAYS_IN], outputs, strict=True):
        shown = stream_text(cell) + stream_text(cell, "stderr")
        assert error_of(cell) is None, (name, error_of(cell), shown)
        assert not [line for line in shown.splitlines() if any(noise in line for noise in NOISE)], (name, shown)
    by_name = dict(zip(["first cell", *WAYS_IN], outputs, strict=True))
    last_line = {name: json.loads(stream_text(cell).strip().splitlines()[-1])
                 for name, cell in by_name.items() if stream_text(cell).strip()}

    assert last_line["first cell"] == {"kernel_widget_bar": True, "kernel_in_notebook": True}  # a notebook
    assert last_line["warm by the next cell"] == [True]
    for name in ("notebook_launcher", "launch with 64 MiB", "%%distributed cell", "session", "sweep", "spawn",
                 "after the template was killed"):
        assert last_line[name] and all(found == PLAIN for found in last_line[name]), (name, last_line[name])
    assert "a warning from the rank" in stream_text(by_name["notebook_launcher"], "stderr")
    assert last_line["pytorch/examples style"] == [True]


TRAINER_FIRST_CELL = """
import torch, transformers
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
import accelnb
"""
TRAINER_CELL = """
import tempfile
folder = tempfile.mkdtemp()
torch.manual_seed(0)
GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                           bos_token_id=0, eos_token_id=0)).save_pretrained(folder)

def train_with_the_trainer(model_path, output_dir):
    model = AutoModelForCausalLM.from_pretrained(model_path)
    tokens = torch.arange(1, 9)
    data = [{"input_ids": tokens, "labels": tokens} for _ in range(32)]
    args = TrainingArguments(output_dir=output_dir, use_cpu=True, max_steps=4, per_device_train_batch_size=2,
                             report_to=[], save_strategy="no", logging_steps=2)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    callbacks = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    return trainer.train().global_step, callbacks

print(accelnb.notebook_launcher(train_with_the_trainer, (folder, folder + "/out"), num_processes=2, cpu=True))
"""


def test_the_hf_trainer_in_a_notebook_that_imported_transformers_draws_text_progress() -> None:
    """transformers picks its notebook progress callback at import in the kernel; the ranks, which
    imported it in the template, pick the console one, and nothing of the widget reaches the cell."""
    outputs = run_notebook([TRAINER_FIRST_CELL, TRAINER_CELL], timeout=300, env=FOLLOWING)
    shown = stream_text(outputs[1]) + stream_text(outputs[1], "stderr")
    assert error_of(outputs[1]) is None, shown
    assert "(4, [" in shown and "ProgressCallback" in shown and "NotebookProgressCallback" not in shown, shown
    assert not [line for line in shown.splitlines() if any(noise in line for noise in NOISE)], shown


@pytest.mark.parametrize("setting", ["off"])
def test_accelnb_template_off_starts_nothing_after_a_cell(setting: str) -> None:
    outputs = run_notebook(["import accelnb", "from accelnb.kernel.helper.template import running_helper_pid\n"
                                              "print(running_helper_pid())",
                            "print(accelnb.notebook_launcher(lambda: 7, num_processes=1, cpu=True, quiet=True))"],
                           env={"ACCELNB_TEMPLATE": setting})
    assert stream_text(outputs[1]).strip() == "None"  # nothing was started in the background
    assert stream_text(outputs[2]).strip() == "7"  # a launch still starts one
