"""Communication: every collective zero3 issues, through one `Communicator` per process group.

No module outside this package calls a ``torch.distributed`` collective (tests/unit/test_structure.py
reads the source), and this package imports nothing from runtime, offload, optim or checkpoint.
"""
