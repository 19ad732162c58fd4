"""The notebook-wide state that displays watch, and how they are told of its changes.

- ``selection``: the GPU picker's default selection (the ipywidgets panel, the JupyterLab side
  panel and ``%distributed`` write it; a launch that names no devices reads it);
- ``observers``: one policy for telling displays about changes: a broken display never breaks
  the caller (the selection's, the run state's and the sweep state's listeners follow it).

Below every other kernel family: planning stays pure, and displays, runs and sweeps all tell
their watchers through ``observers``.
"""
