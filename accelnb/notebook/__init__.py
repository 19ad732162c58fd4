"""The notebook UI: the ``%%distributed`` magic, the ipywidgets panel, the JupyterLab bridge.

Thin adapters over :mod:`accelnb.launcher`; may import the kernel side.
"""
