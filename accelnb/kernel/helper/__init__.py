"""The template process the ranks are forked from, and the payload sent to them.

- ``client``: the kernel's handle on one template process (its socket protocol);
- ``template``: which template this process uses, kept in step with its imports, replaced when stale;
- ``kernel_imports``: what the kernel imported that a template should, and when one is stale;
- ``payload``: packing the user's function and arguments, with precise errors;
- ``cell_sources``: the notebook's cell sources, which the template and then each call give the ranks.
"""
