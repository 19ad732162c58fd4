"""The ranks' Python stacks: asked for while they run, and read from faulthandler's dumps.

- ``live``: ``accelnb.stacks()``, every rank's current stack without stopping it;
- ``faulthandler_dumps``: a dump with only the user's threads and frames, told apart from stderr.
"""
