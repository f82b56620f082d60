"""A short 2-rank training run, as a user's script writes it: init the group, train 3 steps, destroy
the group, exit. tests/multiproc/test_clean_exit.py launches it many times and wants exit code 0."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import zero3  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

torch.set_num_threads(1)
dist.init_process_group("gloo")
cfg = GPTConfig(block_size=8, n_layer=2, n_embd=16)
torch.manual_seed(0)
with zero3.Init():
    model = GPT(cfg)
engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                          {"collective_timeout": 20, "param_persistence_threshold": int(os.environ.get("PERSIST", "0"))})
for step in range(3):
    x, y = synthetic_batch(step * 2 + dist.get_rank(), 2, cfg)
    engine.backward(engine(x, y))
    engine.step()
dist.destroy_process_group()
