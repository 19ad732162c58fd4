"""nbval replays each notebook on the kind of machine its stored outputs were made on: one without GPUs.

The notebooks' outputs are a record of CPU ranks (``--procs 2`` where there is no GPU), and nbval
compares a fresh run with that record. On a machine with GPUs, or with a synthetic inventory
(``ACCELNB_SYNTHETIC_GPUS=4``), the same cells would plan GPU ranks and print other tables. So the
kernel nbval starts for a notebook plans on an empty inventory (``ACCELNB_SYNTHETIC_GPUS=0``: no
GPU, and nothing hidden, which ``CUDA_VISIBLE_DEVICES=""`` would be, and the pre-launch checks
would say so in the cells). Only that kernel: this process's environment is put back as soon as
the kernel started. The doctor's own readings (``%distributed doctor``) still come from NVML.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

NO_GPU = "0"  # ACCELNB_SYNTHETIC_GPUS: an inventory of no GPU


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    # A notebook's first cell's setup starts its kernel (nbval's IPyNbFile.setup), which inherits
    # this process's environment as it is then.
    saved = os.environ.get("ACCELNB_SYNTHETIC_GPUS")
    os.environ["ACCELNB_SYNTHETIC_GPUS"] = NO_GPU
    try:
        return (yield)
    finally:
        if saved is None:
            os.environ.pop("ACCELNB_SYNTHETIC_GPUS")
        else:
            os.environ["ACCELNB_SYNTHETIC_GPUS"] = saved
