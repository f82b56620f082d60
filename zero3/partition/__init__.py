"""Partitioned parameters: the partition math (`sharding`), the per-parameter record and guarded
parameter class (`param`), and the state enums their transitions are checked against (`state`).

The lowest layer above errors and metrics: the communicator, offload, optimizer and runtime all
read and write parameters through it, and it imports none of them.
"""
