"""What the user sees of a run, whatever shows it (the widgets and magics live in ``accelnb.notebook``).

- ``output``: the ranks' output, from raw pipe bytes to what the cell (or terminal) shows;
- ``metrics_history``: every metric the ranks reported, in arrival order;
- ``tensorboard_log``: rank 0's ``report()`` scalars as TensorBoard event files;
- ``byte_sizes``: byte counts as people write and read them (``80.3 KB``);
- ``rank_activity``: each rank's progress from its step windows (the per-rank view's rows, and the
  figures the side panel draws);
- ``straggler_watch``: naming the rank that holds the others back, from the same step windows;
- ``start_table``: the table a launch prints at its start.

Nothing here imports ``kernel/run``: the run pushes what happens into these.
"""
