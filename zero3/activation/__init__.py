"""Activation checkpointing (DeepSpeed's ``deepspeed.checkpointing``): recompute a function's
activations in backward instead of keeping them, with partitioned and CPU-offloaded inputs
(`checkpointing`, public as ``zero3.checkpointing``), and the model-parallel RNG tracker (`rng`,
which imports only torch so that sharded checkpoints can save its states without the runtime).

Not to be confused with `zero3.checkpoint` (saving and loading training state). This file imports
nothing: ``import zero3.activation.rng`` stays light.
"""
