"""In a rank: what lets code written for other launchers run unchanged.

Code people already have was written for ``torchrun``, ``torch.multiprocessing.spawn``, the
PyTorch tutorials, Accelerate's ``notebook_launcher`` or Lightning. Each module here removes one
reason such code fails inside an accelnb rank:

- ``process_group``: the code's own ``init_process_group``/``destroy_process_group`` calls
  reconcile with the group accelnb made;
- ``launches_inside``: a launcher called inside a rank (``mp.spawn``, Accelerate's
  ``notebook_launcher``, Lightning's fork strategies, accelnb itself) runs in place on the rank
  when the numbers agree, and otherwise fails at once with what to write instead;
- ``script_main``: a ``torchrun`` script runs in the rank as ``__main__`` (``%torchrun``).
"""
