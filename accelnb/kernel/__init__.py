"""Code that runs in the notebook's kernel, one folder per family.

- :mod:`accelnb.kernel.planning`: what a launch will be: GPUs, the default selection, how the plan
  maps devices to ranks, each rank's spec, the rendezvous port, Accelerate's config file;
- :mod:`accelnb.kernel.run`: running a launch: the engine, the supervisor's ``WorkerGroup`` (its
  pieces, one job each, in ``run/group/``: the processes and the stop ladder, the channel pump,
  the call protocol the Ray group shares, prompts, live stacks), restarts, the run's state,
  failures and the result;
- :mod:`accelnb.kernel.helper`: the template process the ranks fork from, and the payload it
  delivers to the ranks;
- :mod:`accelnb.kernel.doctor`: ``accelnb.doctor()``'s checks, and the ones before every launch;
- :mod:`accelnb.kernel.stacks`: the ranks' Python stacks, live and in faulthandler's dumps;
- :mod:`accelnb.kernel.display`: what the user sees of a run: output, metrics, TensorBoard log,
  and the one policy for telling displays of changes.

Never imports :mod:`accelnb.worker` or :mod:`accelnb.notebook` (``tests/test_layout.py``).
"""
