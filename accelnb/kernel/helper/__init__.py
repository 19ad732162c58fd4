"""accelnb's helper process, which forks the ranks, and the payload it delivers to them.

- ``client``: the kernel's handle on the helper, started on first use and replaced when it died;
- ``fork_or_spawn``: how the helper comes to life, a fork of the kernel or a fresh interpreter;
- ``openmp_pool``: GNU OpenMP's thread pool, released right before the kernel forks a helper;
- ``payload``: packing the user's function and arguments, with precise errors;
- ``payload_delivery``: how a launch's payload reaches its ranks, a memfd or a fork they inherit.
"""
