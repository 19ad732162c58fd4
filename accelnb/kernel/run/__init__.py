"""Running a launch: start the ranks, run calls on them, stop them, and say what happened.

- ``engine``: the launch engine, start workers, run a call, gather the result;
- ``supervisor``: ``WorkerGroup``, owns the worker processes of a launch, composed of the pieces in
  ``group/`` (the processes and the stop ladder, the channels, the call protocol shared with the
  Ray group, prompts, live stacks);
- ``attempts``: restarts, the loop above the group for ``max_restarts=``;
- ``rank_group``: the shape any group of ranks has, local or on a cluster;
- ``call_outcome``: what one call came to, as data;
- ``failure_report``: failure records, and the one exception for a run;
- ``launch_result``: what a finished launch hands back;
- ``run_state``: the state of the run in progress, for displays, and ``request_stop()``;
- ``rank_prompts``: answering the ranks' ``input()`` and ``(Pdb)`` prompts;
- ``live_stacks``: ``accelnb.stacks()``, the running ranks' stacks without stopping them;
- ``sigterm``: a SIGTERM to the kernel or script as a Stop press.
"""
