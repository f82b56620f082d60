"""Offload: where model state lives (`policy`), the one writer of shard residence (`residence`), the
NVMe tier (`swapfile`, `pool`, `nvme`), and `offload_states` / `reload_states` between phases (`states`)."""
