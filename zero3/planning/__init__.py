"""Planning: the recorded step (`trace`) and the pure planner over it (`schedule`).

Pure data and arithmetic over module sizes and visit order: nothing here touches
``torch.distributed``, a communicator or a live parameter, so every decision can be replayed and
property-tested without a process group (tests/unit/test_structure.py holds the layer rule).
"""
