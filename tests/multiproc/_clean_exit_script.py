"""A short 2-rank training run, as a user's script writes it: init the group and register its
destruction at exit, train 3 steps in ``main()``, return. tests/multiproc/test_clean_exit.py launches
it many times and wants exit code 0 from every rank. The engine outlives ``main()`` in reference
cycles, and the group is destroyed at exit with it still alive: the pattern that aborted the example
DeepSpeed script at exit in 4 of 16 launches before zero3 let go of its groups itself."""

import atexit
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import zero3  # noqa: E402
from gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    atexit.register(dist.destroy_process_group)
    cfg = GPTConfig(block_size=8, n_layer=2, n_embd=16)
    torch.manual_seed(0)
    with zero3.Init():
        model = GPT(cfg)
    engine = zero3.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                              {"collective_timeout": 20, "param_persistence_threshold": 0})
    for step in range(3):
        x, y = synthetic_batch(step * 2 + dist.get_rank(), 2, cfg)
        engine.backward(engine(x, y))
        engine.step()
    out = os.environ["CLEAN_EXIT_DIR"]
    engine.save_checkpoint(out, tag="last")
    engine.save_16bit_model(out, "model.bin")  # the last collectives: a gather to rank 0


if __name__ == "__main__":
    main()
