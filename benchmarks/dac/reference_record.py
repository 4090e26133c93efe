"""Run the DAC reference code (github.com/edvinli/DAC @45209fd, a local checkout the user gives; its
code is not part of this project) on this machine and record what ``reference_check.py`` compares:
the reference's side of the side-by-side pages in ``benchmarks/dac/results/reference_check/``.

    export DAC_DATA=/path/to/data OMP_NUM_THREADS=1      # DAC_DATA holds FashionMNIST/raw/*-ubyte
    python benchmarks/dac/reference_record.py --code /path/to/DAC \\
        --record /tmp/dacref-out/ref_dac_n40_r12_t100_s1.jsonl -- \\
        --dataset fashion-mnist --iid covariate --n_clusters 4 --num_clients 40 --n_rounds 12 --local_ep 3 \\
        --bs 8 --lr 0.01 --n_sampled 5 --n_data_train 100 --n_data_val 100 --tau 30 --DAC --seed 1

Everything after ``--`` goes to the reference's ``main_fed.py`` as its command line. The reference
code trains exactly as it does on its own; this launcher changes only where it runs and what it
records, without editing its files:

- its ``FashionMNIST`` reads ``DAC_DATA`` (else ``FEDCLUSTER_DATA_DIR``) with downloads off;
- its device falls back to the CPU when there is no CUDA (the one change made to its source text,
  in memory: its ``main_fed.py`` hard-codes ``cuda:0``);
- seaborn is optional (it only draws the heat map, which is not drawn here);
- each client's ``train`` is wrapped to count calls; every ``num_clients``-th call ends a round
  (pretraining, then each exchange: with ``sample_frac = 1`` and no early stopping every client
  trains once per round), and the record gets one row per round;
- after the reference's training function returns, the last row is written and the run stops
  before ``main_fed.py``'s own test: that test runs batch size 1 over all 10,000 official test
  images per client (tens of minutes on a CPU); the launcher's final test is the same computation
  (each client's ``best_model`` on its cluster's rotated official test images, the reference's
  test transform) on the first ``--final-test`` of them in batches of 500.

The test images are rotated once, with the reference's own ``transforms.RandomRotation`` inside
``torch.random.fork_rng``, so recording draws nothing from the random streams the training uses.

The record (JSON lines, read by ``reference_check.py --reference``): ``{"round": r, "best": [...],
"local": [...], "seconds": s}`` per round, ``r = -1`` after pretraining and ``0 .. n_rounds - 1``
after each exchange, the accuracy in % of each client's ``best_model`` and ``local_model`` on its
cluster's first ``--record-test`` rotated test images, clients in the reference's order; then
``{"final_full_test": [four cluster means in %], "cluster_idx": [...], "n_sampled": [[...]],
"seconds": s}`` (``n_sampled`` row i: how often client i sampled each client).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

REFERENCE_COMMIT = "45209fd"
# The one edit to the reference's source text, and the line it must find (else: another commit).
CUDA_LINE = 'device = torch.device("cuda:"+cuda_no)'
CPU_FALLBACK = 'device = torch.device("cuda:"+cuda_no if torch.cuda.is_available() else "cpu")'
TRAINING_FUNCTIONS = ("train_DAC", "gossip", "train_pens")


class Recorder:
    """One run's record: the rotated test images, the per-round rows and the last row."""

    def __init__(self, path: Path, namespace: dict, record_test: int, final_test: int) -> None:
        self.path, self.namespace = path, namespace
        self.record_test, self.final_test = record_test, final_test
        self.started = time.perf_counter()
        self.calls = 0
        self.test: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def rotated_test_sets(self) -> None:
        """Each cluster's first ``final_test`` official test images through the reference's test
        transform (``create_test_data``: ToTensor, Normalize(0.5, 0.5), RandomRotation((d, d)))."""
        from torchvision import datasets, transforms

        raw = datasets.FashionMNIST(data_root(), train=False, download=False)
        for cluster, degrees in enumerate(self.namespace["rot_deg"]):
            transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,)),
                                            transforms.RandomRotation(degrees=(degrees, degrees))])
            with torch.random.fork_rng(devices=[]):  # RandomRotation draws its (fixed) angle from torch's stream
                images = torch.stack([transform(raw[i][0]) for i in range(self.final_test)])
            self.test[cluster] = images, torch.as_tensor(raw.targets[: self.final_test])

    def accuracy(self, model: torch.nn.Module, cluster: int, count: int) -> float:
        images, labels = self.test[cluster]
        device = next(model.parameters()).device
        model.eval()
        correct = 0
        with torch.no_grad():
            for start in range(0, count, 500):
                batch = images[start:min(start + 500, count)].to(device)
                correct += (model(batch).argmax(1).cpu() == labels[start:start + len(batch)]).sum().item()
        return 100.0 * correct / count

    def clusters(self) -> list[int]:
        return [int(c) for c in self.namespace["cluster_idx"]]

    def write(self, row: dict) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(row) + "\n")

    def on_train(self, clients: list) -> None:
        """After every client's training: a round ends with the ``len(clients)``-th call."""
        self.calls += 1
        if self.calls % len(clients):
            return
        clusters = self.clusters()
        self.write({"round": self.calls // len(clients) - 2,  # -1: pretraining
                    "best": [self.accuracy(c.best_model, k, self.record_test) for c, k in zip(clients, clusters)],
                    "local": [self.accuracy(c.local_model, k, self.record_test) for c, k in zip(clients, clusters)],
                    "seconds": round(time.perf_counter() - self.started, 1)})

    def finish(self, clients: list) -> None:
        clusters = self.clusters()
        final = [self.accuracy(c.best_model, k, self.final_test) for c, k in zip(clients, clusters)]
        means = [float(np.mean([a for a, k in zip(final, clusters) if k == cluster]))
                 for cluster in range(len(self.namespace["rot_deg"]))]
        self.write({"final_full_test": means, "cluster_idx": clusters,
                    "n_sampled": [c.n_sampled.tolist() for c in clients],
                    "seconds": round(time.perf_counter() - self.started, 1)})


def data_root() -> str:
    root = os.environ.get("DAC_DATA") or os.environ.get("FEDCLUSTER_DATA_DIR")
    if not root or not (Path(root) / "FashionMNIST" / "raw").is_dir():
        raise SystemExit(f"error: DAC_DATA (or FEDCLUSTER_DATA_DIR) must name a folder with FashionMNIST/raw; got {root!r}")
    return root


def wrap_training(utils: types.ModuleType, recorder: Recorder) -> None:
    """The reference's training functions, each client's ``train`` counted, the record finished after."""

    def wrap(function):
        @functools.wraps(function)
        def wrapped(n_rounds, n_local_epochs, clients, *rest):
            if not recorder.test:
                recorder.rotated_test_sets()
            for client in clients:
                if not getattr(client, "_recorded", False):
                    original = client.train

                    def train(*a, _original=original, **k):
                        result = _original(*a, **k)
                        recorder.on_train(clients)
                        return result

                    client.train, client._recorded = train, True
            result = function(n_rounds, n_local_epochs, clients, *rest)
            if function.__name__ != "train_pens":  # PENS's selection phase is followed by gossip
                recorder.finish(result)
                raise SystemExit(0)  # before main_fed.py's own batch-1 test over 10,000 images
            return result

        return wrapped

    for name in TRAINING_FUNCTIONS:
        setattr(utils, name, wrap(getattr(utils, name)))


def main() -> None:
    argv = sys.argv[1:]
    ours, theirs = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", type=Path, required=True, help="a checkout of github.com/edvinli/DAC @45209fd")
    parser.add_argument("--record", type=Path, required=True, help="the JSON-lines record to write (refused if it exists)")
    parser.add_argument("--record-test", type=int, default=200, help="test images per round row")
    parser.add_argument("--final-test", type=int, default=2000, help="test images for the last row")
    args = parser.parse_args(ours)
    main_fed = args.code / "main_fed.py"
    if not main_fed.is_file() or not (args.code / "utils.py").is_file():
        raise SystemExit(f"error: --code: {args.code} has no main_fed.py and utils.py (a checkout of edvinli/DAC)")
    source = main_fed.read_text()
    if source.count(CUDA_LINE) != 1:
        raise SystemExit(f"error: --code: {main_fed} is not the reference at {REFERENCE_COMMIT} (its device line is not there)")
    if args.record.exists():
        raise SystemExit(f"error: --record: {args.record} exists; records are never overwritten")
    if "--dataset" not in theirs or theirs[theirs.index("--dataset") + 1] != "fashion-mnist":
        raise SystemExit("error: the reference's command line (after --) must say --dataset fashion-mnist")
    args.record.parent.mkdir(parents=True, exist_ok=True)
    root = data_root()

    import torchvision

    torchvision.datasets.FashionMNIST = _rooted(torchvision.datasets.FashionMNIST, root)
    if "seaborn" not in sys.modules:
        try:
            import seaborn  # noqa: F401
        except ImportError:
            sys.modules["seaborn"] = types.ModuleType("seaborn")  # heat maps only; none is drawn here
    sys.path.insert(0, str(args.code))
    import utils  # the reference's utils.py

    namespace = {"__name__": "__main__", "__file__": str(main_fed)}
    recorder = Recorder(args.record, namespace, args.record_test, args.final_test)
    wrap_training(utils, recorder)
    sys.argv = [str(main_fed), *theirs]
    os.makedirs(args.code / "save" / "figures", exist_ok=True)
    os.chdir(args.code)  # it appends a row to ./save/results at the start
    try:
        # its main block, as `python main_fed.py` runs it (S102: the user's own checkout, one line edited)
        exec(compile(source.replace(CUDA_LINE, CPU_FALLBACK), str(main_fed), "exec"), namespace)  # noqa: S102
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise
    if not args.record.is_file() or "final_full_test" not in args.record.read_text().splitlines()[-1]:
        raise SystemExit(f"error: the reference finished without a last record row in {args.record}")
    print(f"{args.record}: {json.loads(args.record.read_text().splitlines()[-1])['final_full_test']}")


def _rooted(dataset_class, root: str):
    """The reference's ``FashionMNIST('.', ..., download=True)`` read from ``root``, downloads off."""

    def make(_root, *args, **kwargs):
        kwargs["download"] = False
        return dataset_class(root, *args, **kwargs)

    return make


if __name__ == "__main__":
    main()
