"""What the user sees of a run, whatever shows it (the widgets and magics live in ``accelnb.notebook``).

- ``output``: the ranks' output, from raw pipe bytes to what the cell (or terminal) shows;
- ``metrics_history``: every metric the ranks reported, in arrival order;
- ``tensorboard_log``: rank 0's ``report()`` scalars as TensorBoard event files;
- ``observers``: one policy for telling displays about changes, a broken one never breaks the caller;
- ``byte_sizes``: byte counts as people write and read them (``80.3 KB``).
"""
