"""The pieces a group of ranks is made of, one job each.

:class:`~accelnb.kernel.run.supervisor.WorkerGroup` (ranks forked on this machine) composes all
of them; ``accelnb.cluster.ray_group.RayRankGroup`` (one Ray actor per rank) shares the three that
do not care what runs the ranks:

- ``call_protocol``: waiting for a call's answers and ending the call (what to stop, and how
  patiently, for each ending), over a :class:`~accelnb.kernel.run.group.call_protocol.CallRanks`
  port each group fills with its own functions (shared);
- ``call_answers``: what came back for one call, and the rank events both backends turn into it
  (shared);
- ``rank_phases``: the run's rank states that displays follow (shared);
- ``rank_processes``: the local processes' lifecycle: fork via the helper, undo a half start, the
  SIGTERM → grace → SIGKILL ladder, bury after the helper died; it reports what happened and
  decides nothing about failures;
- ``channel_pump``: the four channels of each local rank, and the selector that reads them;
- ``rank_inboxes``: what the kernel writes into the local ranks' inboxes (a call, a prompt's reply,
  ``Shutdown``), and how far a write got;
- ``prompt_answers``: the local ranks' ``input()``/pdb prompts, answered from the kernel's
  ``input()``;
- ``live_stack_requests``: live stack dumps (``wire/stack_signals``) served by whichever thread pumps the pipes.
"""
