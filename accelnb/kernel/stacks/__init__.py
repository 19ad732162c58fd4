"""The ranks' Python stacks as text: dumps in faulthandler's format, read and cleaned.

- ``faulthandler_dumps``: a dump with only the user's threads and frames, told apart from stderr.

Asking running ranks for their stacks (``accelnb.stacks()``) is the run's job:
``kernel/run/live_stacks.py`` and ``kernel/run/group/live_stack_requests.py``.
"""
