"""What a launch will be, decided before anything starts: the GPUs, the ranks and what each gets.

- ``rank_plan``: pure planning, a device selection and an inventory in, one spec per rank out
  (how the plan maps GPUs to ranks);
- ``inventory``: the machine's GPUs, read from NVML without initialising CUDA (or synthetic);
- ``rank_environment``: the one function that builds a rank's environment variables, for the ranks
  of this machine and of a cluster alike;
- ``worker_specs``: from a plan to what the helper forks (or a cluster's actors set up), and the
  start table the cell shows;
- ``ports``: the rendezvous address and port, checked and bound before any worker starts;
- ``accelerate_config``: Accelerate's config file, read as ``accelerate launch`` reads it.
"""
