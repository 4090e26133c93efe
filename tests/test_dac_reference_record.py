"""benchmarks/dac/reference_record.py: running the DAC reference code from a user's checkout and
recording its rounds. The reference code is not part of the project, so these tests run the
launcher on a stand-in checkout with the same shape (a ``main_fed.py`` with the reference's device
line and module-level ``rot_deg`` / ``cluster_idx``; a ``utils.py`` with its training functions) on
a tiny Fashion-MNIST in the torchvision file layout."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "dac" / "reference_record.py"

STAND_IN_MAIN = '''
import argparse, copy
import numpy as np
import torch, torchvision
from torchvision import transforms
from utils import *

parser = argparse.ArgumentParser()
for name in ("--dataset", "--n_rounds", "--num_clients", "--seed"):
    parser.add_argument(name)
parser.add_argument("--DAC", action="store_true")
args = parser.parse_args()
torch.manual_seed(int(args.seed))
cuda_no = "0"
device = torch.device("cuda:"+cuda_no)
train_dataset = torchvision.datasets.FashionMNIST('.', train=True, download=True, transform=transforms.ToTensor())
rot_deg = [0, 180, 10, 350]
n = int(args.num_clients)
cluster_idx = np.array([0] * (n - 3) + [1, 2, 3])

class Client:
    def __init__(self):
        self.local_model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10)).to(device)
        self.best_model = copy.deepcopy(self.local_model)
        self.n_sampled = np.zeros(n)
    def train(self, epochs):
        with torch.no_grad():
            for p in self.local_model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        self.best_model.load_state_dict(self.local_model.state_dict())
        with open("trained.txt", "a") as out:  # what the training drew from torch's stream
            out.write(f"{float(self.local_model[1].bias.sum()):.10f}\\n")

clients = [Client() for _ in range(n)]
clients = train_DAC(int(args.n_rounds), 1, clients, 1.0, 1, 30.0, False) if args.DAC else gossip(int(args.n_rounds), 1, clients, 1.0, 1, False)
open("own_test_reached", "w").write("the launcher stops before the reference's own test")
'''

STAND_IN_UTILS = '''
import numpy as np

def train_DAC(n_rounds, n_local_epochs, clients, sample_frac, n_sampled, tau, var):
    for client in clients:
        client.train(n_local_epochs)
    for _ in range(n_rounds):
        for i, client in enumerate(clients):
            client.n_sampled[(i + 1) % len(clients)] += 1
            client.train(n_local_epochs)
    return clients

gossip = train_DAC

def train_pens(*args):
    raise AssertionError("not used here")
'''


def write_idx(path: Path, array: np.ndarray, magic: int) -> None:
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def stand_in(tmp_path):
    """A stand-in reference checkout and a 30-image Fashion-MNIST (train and test files)."""
    raw = tmp_path / "data" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split in ("train", "t10k"):
        write_idx(raw / f"{split}-images-idx3-ubyte", rng.integers(0, 256, (30, 28, 28)), 2051)
        write_idx(raw / f"{split}-labels-idx1-ubyte", np.arange(30) % 10, 2049)
    for name in os.listdir(raw):  # torchvision looks for the archives' names too
        (raw / f"{name}.gz").write_bytes(gzip.compress((raw / name).read_bytes()))
    code = tmp_path / "DAC"
    code.mkdir()
    (code / "main_fed.py").write_text(textwrap.dedent(STAND_IN_MAIN))
    (code / "utils.py").write_text(textwrap.dedent(STAND_IN_UTILS))
    return tmp_path


def launch(stand_in: Path, record: Path, *extra: str, rounds: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "DAC_DATA": str(stand_in / "data"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--code", str(stand_in / "DAC"), "--record", str(record), "--final-test", "20",
         "--record-test", "10", *extra, "--", "--dataset", "fashion-mnist", "--n_rounds", str(rounds),
         "--num_clients", "5", "--seed", "1", "--DAC"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False)


def test_the_launcher_records_every_round_and_stops_before_the_references_own_test(stand_in):
    record = stand_in / "out" / "ref_dac_n5_r2_t100_s1.jsonl"
    done = launch(stand_in, record)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert [row["round"] for row in rows[:-1]] == [-1, 0, 1]  # pretraining, then each exchange
    assert all(len(row["best"]) == len(row["local"]) == 5 for row in rows[:-1])
    assert all(0 <= a <= 100 for row in rows[:-1] for a in row["best"] + row["local"])
    final = rows[-1]
    assert len(final["final_full_test"]) == 4 and final["cluster_idx"] == [0, 0, 1, 2, 3]
    assert np.asarray(final["n_sampled"]).sum() == 2 * 5  # one draw per client per exchange
    assert not (stand_in / "DAC" / "own_test_reached").exists()
    # the record is what reference_check.py reads as the reference's side
    check = load_benchmark("dac/reference_check.py")
    parsed = check.reference(record)
    assert parsed["seed"] == 1 and len(parsed["best_180"]) == 3 and parsed["own_draws_180"] == 0.0

    # recording draws nothing from the training's random stream: the same training without the record
    trained = (stand_in / "DAC" / "trained.txt").read_text()
    (stand_in / "DAC" / "trained.txt").unlink()
    plain_run = textwrap.dedent("""
        import sys, torchvision
        dataset, root = torchvision.datasets.FashionMNIST, sys.argv[1]
        torchvision.datasets.FashionMNIST = lambda _root, **kwargs: dataset(root, **{**kwargs, "download": False})
        sys.argv = ["main_fed.py", "--dataset", "fashion-mnist", "--n_rounds", "2", "--num_clients", "5", "--seed", "1", "--DAC"]
        main = open("main_fed.py").read().replace('torch.device("cuda:"+cuda_no)', 'torch.device("cpu")')
        exec(compile(main, "main_fed.py", "exec"), {"__name__": "__main__"})
    """)
    env = {**os.environ, "PYTHONPATH": str(stand_in / "DAC")}
    subprocess.run([sys.executable, "-c", plain_run, str(stand_in / "data")], cwd=stand_in / "DAC", env=env,
                   check=True, timeout=300)
    assert (stand_in / "DAC" / "trained.txt").read_text() == trained


def test_the_launcher_refuses_another_checkout_and_never_overwrites_a_record(stand_in, tmp_path):
    record = stand_in / "out" / "ref.jsonl"
    record.parent.mkdir()
    record.write_text("{}\n")
    refused = launch(stand_in, record)
    assert refused.returncode != 0 and "--record" in refused.stderr and "never overwritten" in refused.stderr
    assert record.read_text() == "{}\n"
    main = stand_in / "DAC" / "main_fed.py"
    main.write_text(main.read_text().replace('torch.device("cuda:"+cuda_no)', 'torch.device("cpu")'))
    refused = launch(stand_in, stand_in / "out" / "other.jsonl")
    assert refused.returncode != 0 and "--code" in refused.stderr and "45209fd" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_the_rotated_test_sets_leave_the_random_stream_where_it_was(stand_in, monkeypatch):
    """RandomRotation((d, d)) draws its angle from torch's stream; the recorder rotates inside
    fork_rng, so a record taken between rounds cannot change what the reference trains next."""
    module = load_benchmark("dac/reference_record.py")
    monkeypatch.setenv("DAC_DATA", str(stand_in / "data"))
    recorder = module.Recorder(stand_in / "r.jsonl", {"rot_deg": [0, 180, 10, 350]}, record_test=10, final_test=20)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    recorder.rotated_test_sets()
    assert torch.equal(torch.get_rng_state(), before)
    images, labels = recorder.test[1]
    assert images.shape == (20, 1, 28, 28) and labels.tolist() == [i % 10 for i in range(20)]
    # 180°: the 0° image turned upside down (the reference's transform: normalised, then rotated)
    assert torch.allclose(images[0], torch.flip(recorder.test[0][0][0], dims=(1, 2)))
