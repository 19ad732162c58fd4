"""Code that runs in the helper process and in each rank's worker process.

Imports only :mod:`accelnb.wire` and :mod:`accelnb.errors`, so a worker never loads kernel or UI code.
"""
