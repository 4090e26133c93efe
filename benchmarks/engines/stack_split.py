"""Does the way the batched engine cuts a training stack change what its clients learn?

    python benchmarks/engines/stack_split.py                       # 10 cnn_zec_fmnist clients, Adam, 2 epochs
    python benchmarks/engines/stack_split.py --model mlp_fmnist --optimizer sgd

The same clients (same models, data and batch order) are trained with the stacked step once as one
stack and then cut into stacks of other sizes, as ``simulation.batched_workers`` and
``simulation.batched_memory_gb`` cut them (``engines.batched.BatchPolicy.chunks``); each line prints,
per client, the largest parameter difference from the one-stack run ("0": the same bits). On one
torch thread, synthetic data (a question of kernels, not of accuracy). What it measured is in
docs/how-to/engines.md, "Same results?".
"""

from __future__ import annotations

import argparse
import copy

import torch

from fedcluster_flwr.engines.stacked import ClientBatchData, train_stacked
from fedcluster_flwr.models import build_model
from fedcluster_flwr.training import TrainSettings

SPLITS = ([1] * 10, [2] * 5, [3, 3, 3, 1], [4, 4, 2], [5, 5], [6, 4], [7, 3], [8, 2], [9, 1])


def trained(base: list[torch.nn.Module], data: list[ClientBatchData], settings: TrainSettings,
            split: list[int]) -> list[torch.Tensor]:
    """Each client's parameters, flattened, after training in consecutive stacks of ``split``'s sizes."""
    models, start = copy.deepcopy(base), 0
    for size in split:
        chunk = range(start, start + size)
        train_stacked([models[i] for i in chunk], [data[i] for i in chunk], settings,
                      [torch.Generator().manual_seed(i) for i in chunk], torch.device("cpu"))
        start += size
    return [torch.cat([p.detach().flatten() for p in m.parameters()]) for m in models]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="cnn_zec_fmnist")
    parser.add_argument("--samples", type=int, default=64, help="per client")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--lr", type=float, default=0.001)
    args = parser.parse_args()
    torch.set_num_threads(1)
    clients = sum(SPLITS[0])
    settings = TrainSettings(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, optimizer=args.optimizer,
                             momentum=0.0, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    data = [ClientBatchData(torch.randn(args.samples, 1, 28, 28, generator=generator),
                            torch.randint(0, 10, (args.samples,), generator=generator)) for _ in range(clients)]
    torch.manual_seed(0)
    base = [build_model(args.model, (1, 28, 28), 10) for _ in range(clients)]
    one_stack = trained(base, data, settings, [clients])
    print(f"{clients} {args.model} clients, {args.optimizer}, {args.epochs} epochs, {args.samples} samples a client, "
          f"batch {args.batch_size}: largest parameter difference per client from one stack of {clients}")
    for split in SPLITS:
        differences = [float((a - b).abs().max()) for a, b in zip(trained(base, data, settings, split), one_stack)]
        print(f"stacks of {split}: " + " ".join("0" if d == 0 else f"{d:.1e}" for d in differences))


if __name__ == "__main__":
    main()
