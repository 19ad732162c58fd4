"""What the notebook's user does to a running rank, on the rank's side.

- ``rank_input``: ``input()`` and ``getpass`` answered from the cell (the prompt goes to the
  kernel, the answer comes back);
- ``rank_debugger``: pdb at a rank's prompt, ``breakpoint()`` included;
- ``rank_interrupts``: what a Ctrl-C (SIGINT) does at each point of a call;
- ``stack_dump``: the rank's Python stacks when the kernel asks (a ``timeout=``, the Stacks
  button, ``accelnb.stacks()``), written so that the dump cannot crash the rank.
"""
