"""``accelnb.doctor()``: the environment problems that break distributed runs, found before launch.

- ``checks``: every check (ok, warn or fail, what it saw, how to fix it), from ``MachineFacts``;
- ``gpu_health``: the GPU facts the checks judge, read from NVML or given by a test;
- ``preflight``: the cheap checks, run before every launch;
- ``report``: what the doctor found, as ``Check`` records and as a table.
"""
