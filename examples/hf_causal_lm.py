"""Fine-tune a Hugging Face causal LM with zero3 on CPU ranks: from a save_pretrained directory to one.

    python3 examples/hf_causal_lm.py                  # starts 2 gloo ranks itself
    python3 examples/hf_causal_lm.py --out /tmp/ft    # keep the fine-tuned model in /tmp/ft
    torchrun --nproc-per-node 2 examples/hf_causal_lm.py --out /tmp/ft

Needs ``pip install -e '.[hf]'`` (transformers). Nothing is downloaded (``HF_HUB_OFFLINE=1``):

1. A stand-in for a downloaded checkpoint: rank 0 builds a tiny Llama (byte-level vocabulary) from
   its config and writes it with ``save_pretrained`` (skipped when ``--pretrained`` already holds one).
2. ``zero3.from_pretrained(AutoModelForCausalLM, path)`` on every rank: it builds the model under
   ``zero3.Init`` without random initialisation, and each rank reads only its slice of every tensor
   from ``model.safetensors``, so no rank ever holds the full model (with ``--persistence`` 0, the
   default here; parameters under a persistence threshold are kept whole on every rank).
3. ``zero3.initialize`` with AdamW; each rank trains on its half of every batch.
4. ``model.generate()`` (greedy) completes each line from its first two words.
5. ``engine.save_pretrained(out)`` gathers one tensor at a time onto rank 0, which writes it into
   its shard file (``--max-shard-size``, small here so the tiny model is split into several files
   with a ``model.safetensors.index.json``, as a large one would be); ``AutoModelForCausalLM.from_pretrained``
   reads the directory back and must generate the same text.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a tiny local model only: never reach for the hub

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zero3  # noqa: E402

LINES = [
    "zero3 keeps one shard of every weight on each rank.",
    "a module gathers its weights just before it runs.",
    "gradients are reduced back into shards.",
    "the optimizer steps on this rank's shards only.",
]
PAD, EOS = 0, ord("\n")  # byte-level vocabulary: token = byte value
PROMPT_WORDS = 2


def encode(lines: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) of byte sequences ending in EOS, right-padded with PAD."""
    seqs = [list(line.encode()) + [EOS] for line in lines]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), PAD)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask, ids.masked_fill(mask == 0, -100)


def prompts(lines: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first words of each line, left-padded (decoder-only models generate from the right end)."""
    heads = [" ".join(line.split()[:PROMPT_WORDS]) + " " for line in lines]
    seqs = [list(h.encode()) for h in heads]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), PAD)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s)
        mask[i, width - len(s):] = 1
    return ids, mask


def decode(row: list[int]) -> str:
    return bytes(t for t in row if t not in (PAD, EOS)).decode(errors="replace")


def make_pretrained(path: str, seed: int) -> None:
    """Write a tiny randomly initialised Llama with save_pretrained: what a hub download would be."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=None, eos_token_id=EOS, pad_token_id=PAD)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)


def run(args: argparse.Namespace) -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(LINES) % world:
        raise ValueError(f"{world} ranks cannot split the {len(LINES)} training lines evenly; use 1, 2 or 4")
    if rank == 0 and not os.path.isfile(os.path.join(args.pretrained, "config.json")):
        make_pretrained(args.pretrained, args.seed)
        print(f"1. pretrained stand-in written to {args.pretrained}: {sorted(os.listdir(args.pretrained))}", flush=True)
    dist.barrier()

    # 2. Stream the checkpoint in: built under Init (each rank keeps its shards), each rank reads its slices.
    zero_config = {"param_persistence_threshold": args.persistence}
    model, loaded = zero3.from_pretrained(AutoModelForCausalLM, args.pretrained, dtype=torch.float32,
                                          zero_config=zero_config, strict=True,  # raises on any mismatch
                                          output_loading_info=True)
    model.train()  # from_pretrained returns the model in eval mode, as transformers does
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / args.steps)  # linear to 0
    engine = zero3.initialize(model, optimizer, zero_config, lr_scheduler=decay)  # engine.step() steps it
    held = engine.memory_report()
    n_params = sum(p.ds_numel for p in engine.params)
    for r in range(world):
        if r == rank:
            print(f"2. rank {rank}: loaded {type(model).__name__} ({n_params:,} parameters; missing "
                  f"{sorted(loaded['missing_keys'])}, unexpected {sorted(loaded['unexpected_keys'])}); holds "
                  f"{held['param_shard_bytes']:,} bytes of parameter shards + {held['persistent_param_bytes']:,} of "
                  f"persistent parameters (whole on every rank) of {held['full_param_bytes']:,} parameter bytes",
                  flush=True)
        dist.barrier()

    ids, mask, labels = encode(LINES)
    p_ids, p_mask = prompts(LINES)
    # Every forward is a collective: synced_gpus=True keeps a rank whose sequences ended running
    # forwards until every rank's have (here all ranks use the same prompts, so they end together).
    gen = dict(attention_mask=p_mask, max_new_tokens=64, do_sample=False, pad_token_id=PAD, eos_token_id=EOS,
               synced_gpus=True)
    with torch.no_grad():
        before = model.generate(p_ids, **gen)
    if rank == 0:
        print(f"   before fine-tuning: {decode(before[0].tolist())!r}", flush=True)

    # 3. Fine-tune: each rank takes its share of the lines (the global batch).
    per = len(LINES) // world
    mine = slice(rank * per, (rank + 1) * per)
    t0 = time.perf_counter()
    for step in range(args.steps):
        loss = engine(input_ids=ids[mine], attention_mask=mask[mine], labels=labels[mine]).loss
        engine.backward(loss)
        zero3.clip_grad_norm_(engine, 1.0)  # the global norm over every rank's gradient shards
        engine.step()
        if step % 10 == 0 or step == args.steps - 1:
            loss = loss.detach()
            dist.all_reduce(loss)
            if rank == 0:
                print(f"3. step {step:3d}  loss {loss.item() / world:.4f}", flush=True)
    train_s = time.perf_counter() - t0
    held, peak = engine.memory_report(), engine.last_step_metrics.peak_live_bytes
    if rank == 0:
        print(f"   between steps rank 0 holds {held['param_shard_bytes']:,} bytes of parameter shards, "
              f"{held['persistent_param_bytes']:,} of persistent parameters and {held['optimizer_state_bytes']:,} "
              f"of AdamW state on the shards; the last step had at most {peak:,} parameter bytes gathered at once",
              flush=True)

    # 4. Generate. Every forward of generate() is an inference step that gathers each module's weights.
    gathers = copy.copy(engine.metrics)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(p_ids, **gen)
    gen_s = time.perf_counter() - t0
    gen_peak = engine.last_step_metrics.peak_live_bytes  # of the last forward
    forwards = out.shape[1] - p_ids.shape[1]
    gathered = engine.metrics.allgather_numel - gathers.allgather_numel
    texts = [decode(row) for row in out.tolist()]
    if rank == 0:
        for line, text in zip(LINES, texts):
            print(f"4. {text!r}{'' if text == line else '   (expected ' + repr(line) + ')'}", flush=True)
        print(f"   {args.steps} steps in {train_s:.1f} s; generate(): {forwards} forwards in {gen_s:.2f} s, "
              f"{gathered / forwards:,.0f} elements gathered per forward ({n_params:,} in the model), at most "
              f"{gen_peak:,} bytes at once", flush=True)

    # 5. Save in the Hugging Face format, one gathered tensor at a time: no rank holds the whole model.
    engine.save_pretrained(args.out, max_shard_size=args.max_shard_size)  # a collective: every rank calls it
    if rank == 0:
        back = AutoModelForCausalLM.from_pretrained(args.out)
        t0 = time.perf_counter()
        with torch.no_grad():
            same = torch.equal(back.generate(p_ids, **dict(gen, synced_gpus=False)), out)  # rank 0 alone
        print(f"5. saved {args.out}: {sorted(os.listdir(args.out))}; AutoModelForCausalLM.from_pretrained "
              f"generates the same text: {same} (in {time.perf_counter() - t0:.2f} s, one process, no gathers)",
              flush=True)
        if not same:
            raise RuntimeError(f"the model reloaded from {args.out} generates other tokens than the trained one")


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run(args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="ranks to start when not run under torchrun")
    ap.add_argument("--pretrained", default=None, help="save_pretrained directory to start from "
                    "(default: a temporary one with a tiny Llama written by step 1)")
    ap.add_argument("--out", default=None, help="where to save the fine-tuned model (default: a temporary directory)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--persistence", type=int, default=0,
                    help="param_persistence_threshold (elements); 0 partitions every parameter")
    ap.add_argument("--max-shard-size", default="200KB",
                    help="most bytes per saved file (transformers' max_shard_size; default: small enough "
                    "to split this tiny model, for a real one use e.g. 5GB)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="zero3-hf-") as tmp:
        args.pretrained = args.pretrained or os.path.join(tmp, "pretrained")
        args.out = args.out or os.path.join(tmp, "finetuned")
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
            dist.init_process_group("gloo")
            try:
                paths = [args.pretrained, args.out]
                dist.broadcast_object_list(paths, 0)  # every rank uses rank 0's directories
                args.pretrained, args.out = paths
                run(args)
            finally:
                dist.destroy_process_group()
            return
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, args=(args.nproc, port, args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
