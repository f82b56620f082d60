"""Instructions per training step under valgrind's callgrind: the hook overhead of bench_hooks.py
(DeepSpeed's SimpleModel, 78 x Linear(64,64), world size 1, persistence threshold 0) as a count that
does not move with the machine's load, next to the plain model's.

    python benchmarks/bench_hook_instructions.py                          # plain and zero3 from this tree
    python benchmarks/bench_hook_instructions.py --baseline /path/to/tree  # and zero3 from another tree

Each variant runs in its own process under ``valgrind --tool=callgrind`` with ``PYTHONHASHSEED=0``
(hash order moves the count by about 0.5%), once with ``--short`` and once with ``--long`` timed
steps after 5 warm-up steps; instructions per step are the difference of the two totals over the
difference of the step counts, so start-up and imports cancel. Two runs go at a time (one per
core); a run takes a few minutes. The figures are printed, never asserted.

What an instruction count does not say: time. Interpreted Python and the tensor kernels retire
instructions at different rates, so the ratio of counts is not the ratio of step times
(bench_hooks.py measures those). It resolves changes of 1% that the timed runs on this machine
cannot, and says which way they go.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import sys
sys.path[:0] = [{root!r}, {bench!r}]
import torch
torch.set_num_threads(1)
import bench_hooks as bh
case = bh.simple_case(78, 64, 32)
r = bh.Runner("x", case, None if {plain!r} else {{"param_persistence_threshold": 0}}, 1e-3)
for _ in range(5 + {steps}):
    r.step(False)
print("loss", r.loss)
"""


def _instructions(tree: str, plain: bool, steps: int, workdir: str) -> tuple[int, str]:
    script = os.path.join(workdir, f"child_{os.path.basename(tree)}_{plain}_{steps}.py")
    with open(script, "w") as fh:
        fh.write(CHILD.format(root=tree, bench=os.path.join(ROOT, "benchmarks"), plain=plain, steps=steps))
    out = os.path.join(workdir, os.path.basename(script) + ".cg")
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, script],
                          capture_output=True, text=True, env=env, check=True)
    found = re.search(r"I\s+refs:\s+([\d,]+)", proc.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count in callgrind's output:\n{proc.stderr[-2000:]}")
    loss = re.search(r"loss (\S+)", proc.stdout)
    return int(found.group(1).replace(",", "")), loss.group(1) if loss else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="another source tree whose zero3 runs as a third variant")
    ap.add_argument("--short", type=int, default=10)
    ap.add_argument("--long", type=int, default=40)
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (Debian: apt-get install valgrind)")
    variants = [("plain", ROOT, True), ("zero3, threshold 0", ROOT, False)]
    if args.baseline:
        variants.append((f"zero3, threshold 0 [{args.baseline}]", os.path.abspath(args.baseline), False))
    with tempfile.TemporaryDirectory() as work, concurrent.futures.ThreadPoolExecutor(2) as pool:
        jobs = {(name, n): pool.submit(_instructions, tree, plain, n, work)
                for name, tree, plain in variants for n in (args.short, args.long)}
        rows = []
        for name, _, _ in variants:
            (lo, _), (hi, loss) = jobs[(name, args.short)].result(), jobs[(name, args.long)].result()
            rows.append((name, (hi - lo) / (args.long - args.short), loss))
    base = rows[0][1]
    print(f"# bench_hook_instructions: SimpleModel 78 x Linear(64,64), world size 1, "
          f"({args.long} - {args.short}) steps, PYTHONHASHSEED=0\n")
    print("| variant | instructions per step | vs plain | loss after last step |")
    print("|---|---:|---:|---:|")
    for name, per_step, loss in rows:
        print(f"| {name} | {per_step / 1e6:.2f}M | {per_step / base:.3f}x | {loss} |")


if __name__ == "__main__":
    main()
