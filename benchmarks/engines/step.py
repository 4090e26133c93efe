"""The stacked training step of this checkout against an earlier commit's, side by side in one process
(alternating, one torch thread): ms per client-step and the ratio of each pair.

    python benchmarks/engines/step.py --vs 7eea6f9                          # DAC's CNN, 50 clients, Adam, batch 8
    python benchmarks/engines/step.py --vs 7eea6f9 --model cnn_briggs --optimizer sgd --batch 10

The earlier commit's ``engines/stacked.py`` and ``models.py`` are read with ``git show`` and loaded
as modules of their own; both start from the same weights and data, and the largest parameter
difference after the steps is printed (the two steps compute the same thing to round-off).
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fedcluster_flwr.engines import stacked as new_stacked  # noqa: E402
from fedcluster_flwr.models import build_model  # noqa: E402
from fedcluster_flwr.training import TrainSettings  # noqa: E402


def module_at(commit: str, path: str, name: str) -> types.ModuleType:
    source = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    source = source.replace("from ..training import", "from fedcluster_flwr.training import")
    source = source.replace("from .schema import", "from fedcluster_flwr.declarations.schema import")
    module = types.ModuleType(name)
    module.__dict__["__name__"] = name
    sys.modules[name] = module
    exec(compile(source, f"{commit}:{path}", "exec"), module.__dict__)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vs", required=True, help="the earlier commit")
    parser.add_argument("--model", default="cnn_zec_fmnist")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="adam")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    old_stacked = module_at(args.vs, "fedcluster_flwr/engines/stacked.py", "old_stacked")
    old_models = module_at(args.vs, "fedcluster_flwr/models.py", "old_models")
    shape = (1, 8, 8) if "digits" in args.model else (3, 32, 32) if "cifar" in args.model else (1, 28, 28)
    torch.manual_seed(0)
    new_group = [build_model(args.model, shape, 10) for _ in range(args.clients)]
    old_group = [old_models.build_model(args.model, shape, 10) for _ in range(args.clients)]
    for a, b in zip(old_group, new_group):
        a.load_state_dict(b.state_dict())
    start = [copy.deepcopy(m.state_dict()) for m in new_group]
    samples = args.batch * args.steps
    data = [(torch.randn(samples, *shape), torch.randint(0, 10, (samples,))) for _ in range(args.clients)]
    lr = 1e-3 if args.optimizer == "adam" else 0.05
    settings = TrainSettings(epochs=1, batch_size=args.batch, lr=lr, optimizer=args.optimizer, momentum=0.0, weight_decay=0.0)
    cpu = torch.device("cpu")

    def run(stacked, group):
        for model, state in zip(group, start):
            model.load_state_dict(state)
        batches = [stacked.ClientBatchData(x, y) for x, y in data]
        stacked.train_stacked(group, batches, settings, [torch.Generator().manual_seed(k) for k in range(len(group))], cpu)

    run(old_stacked, old_group), run(new_stacked, new_group)
    pairs = []
    for _ in range(args.repeat):
        started = time.perf_counter()
        run(old_stacked, old_group)
        old = time.perf_counter() - started
        started = time.perf_counter()
        run(new_stacked, new_group)
        pairs.append((old, time.perf_counter() - started))
    per = 1e3 / (args.clients * args.steps)
    diff = max((a - b).abs().max().item() for ma, mb in zip(old_group, new_group)
               for a, b in zip(ma.parameters(), mb.parameters()))
    print(f"{args.model}, {args.clients} clients, {args.optimizer}, batch {args.batch}, {args.steps} steps: "
          f"{args.vs} {min(o for o, _ in pairs) * per:.3f} ms per client-step, this checkout "
          f"{min(n for _, n in pairs) * per:.3f}; ratio per pair {', '.join(f'{n / o:.2f}' for o, n in pairs)}; "
          f"largest parameter difference {diff:.1e}")


if __name__ == "__main__":
    main()
