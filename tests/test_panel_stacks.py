"""The panel's Stacks button shows every rank's stack while the launching cell blocks, and stops nothing.

A real ipykernel shows ``accelnb.Panel()`` and then launches a 2-rank CPU run whose ranks wait,
in a function with a recognisable name, for a file this test creates. While that cell blocks,
the test sends what a click on Stacks sends (a ``comm_msg`` to the button's comm) and waits for
the panel's stacks view to be updated on IOPub with both ranks' frames. Then it lets the ranks
finish: the run must end normally, with both values, having lost nothing to the look.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from tests.test_panel_kernel import Kernel, is_status, kernel, shows_running

__all__ = ["kernel"]  # the module-scoped kernel fixture, shared with the Stop button's tests

SETUP = """
import json
from accelnb import launch
from accelnb.kernel.helper.template import shared_helper
from accelnb.notebook.panel import Panel
panel = Panel(refresh_interval=None)
display(panel)
print(json.dumps({"stacks": panel.stacks_button.model_id, "view": panel.stacks_view.model_id,
                  "helper": shared_helper().pid}))
"""

RUN = """
def train_step_waiting_for_the_test(path):
    import os, time
    while not os.path.exists(path):
        time.sleep(0.05)
    return os.environ["RANK"]

result = launch(train_step_waiting_for_the_test, ({path!r},), num_processes=2, cpu=True, quiet=True)
print("values", sorted(result.values.items()))
"""


def stacks_shown(view_id: str) -> Any:
    def shown(message: dict[str, Any]) -> bool:
        if message["header"]["msg_type"] != "comm_msg" or message["content"]["comm_id"] != view_id:
            return False
        value = message["content"]["data"].get("state", {}).get("value", "")
        return "── rank 1 ──" in value
    return shown


def test_stacks_click_shows_every_ranks_frames_during_a_run(kernel: Kernel) -> None:
    ids = json.loads(kernel.run(SETUP, timeout=120))
    kernel.helper_pid = ids["helper"]
    with tempfile.TemporaryDirectory() as folder:
        release = Path(folder) / "go"
        run_id = kernel.client.execute(RUN.format(path=str(release)))
        kernel.wait_for(is_status(run_id, "busy"), timeout=10)
        kernel.wait_for(lambda m: shows_running(m) and sum(shows_running(x) for _, x in kernel.seen) >= 2,
                        timeout=60)
        kernel.click(ids["stacks"])
        shown = kernel.wait_for(stacks_shown(ids["view"]), timeout=20)["content"]["data"]["state"]["value"]
        for rank in (0, 1):
            section = shown.split(f"── rank {rank} ──")[1].split("── rank")[0]
            assert "in train_step_waiting_for_the_test" in section, shown
        assert "nothing was stopped" in shown
        release.touch()
        _, reply = kernel.reply_to(run_id, timeout=60)
    assert reply["content"]["status"] == "ok", reply["content"]
    kernel.wait_for(is_status(run_id, "idle"), timeout=10)
    assert "values [(0, '0'), (1, '1')]" in kernel.stdout_of(run_id)  # the run went on, whole
    cell_text = "".join(m["content"].get("text", "") for _, m in kernel.seen
                        if m["parent_header"].get("msg_id") == run_id and m["header"]["msg_type"] == "stream")
    assert "most recent call first" not in cell_text  # the dumps went to the panel, not the cell
