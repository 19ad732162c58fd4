"""What crosses between the kernel and the workers: specs, events, messages, pickling.

Imported by both sides; imports nothing of accelnb's but :mod:`accelnb.errors`.
"""
