"""Code that runs in the notebook's kernel, one folder per family.

- :mod:`accelnb.kernel.watched_state`: the notebook-wide state displays watch (the GPU picker's
  selection) and the one policy for telling them of changes;
- :mod:`accelnb.kernel.planning`: what a launch will be: GPUs, how the plan maps devices to ranks,
  each rank's spec, the rendezvous port, Accelerate's config file;
- :mod:`accelnb.kernel.run`: running a launch: the engine, the supervisor's ``WorkerGroup`` (its
  pieces, one job each, in ``run/group/``: the processes and the stop ladder, the channel pump,
  the call protocol the Ray group shares, prompts, live stacks), restarts, the run's state,
  failures and the result;
- :mod:`accelnb.kernel.helper`: the template process the ranks fork from, and the payload it
  delivers to the ranks;
- :mod:`accelnb.kernel.doctor`: ``accelnb.doctor()``'s checks, and the ones before every launch;
- :mod:`accelnb.kernel.stacks`: the ranks' Python stacks as text, from dumps in faulthandler's format;
- :mod:`accelnb.kernel.display`: what the user sees of a run: output, metrics, TensorBoard log,
  each rank's progress and the straggler.

The families import one another one way only, bottom up: watched_state, planning, display,
stacks, helper, run, then sweep and doctor (``tests/test_layout.py`` checks that no two import
each other, directly or round a loop). Never imports :mod:`accelnb.worker` or
:mod:`accelnb.notebook`.
"""
