"""The template: the clean process every local rank is forked from (it runs in a process of its
own, started by ``kernel/helper/client.py``, never a fork of the kernel).

- ``helper``: its main loop, ``python -m accelnb.worker.template.helper``: follows the kernel's
  imports, forks ranks on request, reaps them and whatever they left behind;
- ``imports``: what it imports, and the checks that keep it fit to fork;
- ``standby_ranks``: the children it forks while idle, which a launch takes as its ranks; they
  join the next launch's group ahead, where the kernel says which it will be (``wire/group_ahead.py``).
"""
