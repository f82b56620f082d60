"""Activation checkpointing (DeepSpeed's ``deepspeed.checkpointing``): recompute a function's
activations in backward instead of keeping them, with partitioned and CPU-offloaded inputs and the
model-parallel RNG tracker. Public as ``zero3.checkpointing``.

Not to be confused with `zero3.checkpoint` (saving and loading training state).
"""
