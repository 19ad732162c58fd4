"""A Stop that saves, on the rank's side: the kernel's stop request, the ranks' agreement on when
to honour it, and the callbacks that make the HF Trainer, Lightning and Accelerate honour it.

- ``rank_stop``: the rank's Stop, whole: the request as this rank heard it (its receiver
  delivers it), telling the kernel once per call that the code checks for one, and
  :func:`~accelnb.worker.stopping.rank_stop.stop_requested`, the same answer on every rank at the
  same call number;
- ``accelerate_trigger``: Accelerate's ``check_trigger()`` also answers a stop request;
- ``library_callbacks``: an HF ``TrainerCallback`` and a Lightning ``Callback`` that save and stop.
Both adapters read the request through ``rank_stop``; neither decides anything of its own.
"""
