"""Code that runs in the notebook's kernel: planning, the helper client, supervision, output.

Never imports :mod:`accelnb.worker` or :mod:`accelnb.notebook`.
"""
