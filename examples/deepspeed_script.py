"""A training script written for DeepSpeed ZeRO-3, run on zero3 by changing one line: the import.

    torchrun --nproc-per-node 2 examples/deepspeed_script.py --deepspeed --deepspeed_config \\
        examples/deepspeed_config.json --save_dir /tmp/ds_run

trains a small regression MLP for ``--steps`` optimizer steps, saves a checkpoint after
``--save_at`` of them and the 16-bit model at the end. ``--resume`` continues from the latest
checkpoint instead; its losses equal the first run's from there on. With ``--loss_file`` rank 0
writes ``{step: loss}`` as JSON. Everything below the import is DeepSpeed's API as DeepSpeed's
documentation uses it.
"""

import argparse
import json
import os

import torch
from torch import nn

import zero3.deepspeed as deepspeed  # was: import deepspeed


class Net(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                                  nn.Linear(width, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.body(x).squeeze(-1), y)


def batch(step: int, micro: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch: the same data whatever the run, so a resumed run sees what the first saw."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(size, 16, generator=g)
    return x, torch.sin(x.sum(-1))


def get_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="DeepSpeed ZeRO-3 example")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps in all")
    parser.add_argument("--save_at", type=int, default=3, help="save a checkpoint after this many steps")
    parser.add_argument("--save_dir", type=str, required=True)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--loss_file", type=str, default=None)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = get_args()
    deepspeed.init_distributed()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = Net().to(device)  # on this rank's GPU when there is one
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(args=args, model=model,
                                                              model_parameters=model.parameters())
    micro_batch = engine.train_micro_batch_size_per_gpu()  # as the config says (comments allowed in it)
    start = 0
    if args.resume:
        _, client_state = engine.load_checkpoint(args.save_dir)
        start = client_state["step"]
    losses = {}
    for step in range(start, args.steps):
        total = 0.0
        for micro in range(engine.gradient_accumulation_steps()):
            x, y = batch(step, micro, engine.global_rank, micro_batch)
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            total += loss.item() / engine.gradient_accumulation_steps()
        losses[step] = total
        if engine.global_rank == 0:
            norm = engine.get_global_grad_norm()  # None without gradient_clipping, as DeepSpeed's (probe 38K)
            print(f"step {step} loss {total:.6f} lr {lr_scheduler.get_last_lr()[0]:.2e} "
                  f"grad norm {'-' if norm is None else f'{norm:.4f}'}", flush=True)
        if step + 1 == args.save_at and not args.resume:
            engine.save_checkpoint(args.save_dir, tag=f"step{step + 1}", client_state={"step": step + 1})
    engine.save_16bit_model(args.save_dir, "pytorch_model.bin")
    if args.loss_file and engine.global_rank == 0:
        with open(args.loss_file, "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    main()
