"""Budgets, prefetch and explanations on one process: what the coordinator did and why.

    python examples/explain_schedule.py

Trains the small GPT for a few steps at world size 1 with a tight live budget, then prints the
measured statistics of the last step, the schedule's prediction for the same model built on the
meta device (they agree exactly), and the explanation of one parameter's fate.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zero3  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402
from zero3.plan import predict, record_trace  # noqa: E402

CONFIG = {"param_persistence_threshold": 0, "max_live_parameters": 14_000, "max_reuse_distance": 2_000,
          "prefetch_bucket_size": 3_000}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    cfg = GPTConfig()
    torch.manual_seed(0)
    with zero3.Init():
        model = GPT(cfg)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), CONFIG)
    for step in range(3):
        x, y = synthetic_batch(step, 4, cfg)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    m = engine.last_step_metrics
    print(f"\nmeasured : peak live {m.peak_live_numel:,} elements (cap {CONFIG['max_live_parameters']:,}), "
          f"{m.allgather_calls} all-gathers of {m.allgather_numel:,} elements, "
          f"{m.prefetch_hits} prefetch hits, {m.demand_fetches} demand fetches")

    with torch.device("meta"):
        meta_model = GPT(cfg)
    trace = record_trace(meta_model, lambda: (torch.zeros(4, 64, dtype=torch.long, device="meta"),), CONFIG)
    s = predict(trace, CONFIG).stats
    print(f"predicted: peak live {s.peak_live_numel:,} elements, {s.num_allgathers} all-gathers of "
          f"{s.allgather_numel:,} elements, {s.prefetch_hits} prefetch hits (meta device, nothing run)\n")

    print("Why h.1.mlp.c_fc.weight was gathered and released in the last step:")
    for line in engine.explain("h.1.mlp.c_fc.weight"):
        print("  " + line)


if __name__ == "__main__":
    main()
