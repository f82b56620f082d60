"""Offload: where a shard's bytes and the optimizer's state live (device, host memory, NVMe drive),
the NVMe tier, and `offload_states` / `reload_states` between phases."""
