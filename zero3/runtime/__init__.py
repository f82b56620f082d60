"""The runtime: the per-engine context, the hooks that drive a step, the parameter coordinator
(fetch, prefetch, release), the gradient reducer, leaf modules and ``zero3.Init``."""
