"""A sweep's pieces that have no UI: one trial per configuration, queued onto slots of GPUs.

- ``slots``: pure: how a pool of GPUs (or CPU cores) is cut into the slots trials run on;
- ``trials``: :class:`Trial` and :class:`Trials`, what a sweep hands back (one row per config);
- ``scheduler``: the trial threads, the queue, and one stop for all of them;
- ``sweep_state``: which trial each slot runs, for the side panel.

The public function, which wires the launch engine and the cell's table in, is :mod:`accelnb.sweeper`.
"""
