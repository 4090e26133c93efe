"""The batched engine's evaluation on a CPU: one forward pass per slice of samples over all of a
stack's clients, or the slice's clients in groups of at most ``CPU_PASS_SAMPLES`` samples per pass
(``fedcluster_flwr.engines.stacked.evaluation_sums``); timed alternately in one process on one torch
thread (as each of the batched engine's CPU workers runs), each pass size against one pass, with
whether the clients' loss sums and correct counts are the same bits.

    python benchmarks/engines/evaluation.py --out benchmarks/engines/results/evaluation.json
    python benchmarks/engines/evaluation.py --cases dac_neighbour_losses --passes 128,256 --repeat 9

Cases: one of the engine's CPU evaluation stacks (``batched.CPU_EVALUATION_STACK`` = 8 clients,
hence slices of 512 samples per client) for DAC's full-scale round on Fashion-MNIST
(``cnn_zec_fmnist``: a client scoring a neighbour's model on its 500 training images; the clients'
models on their 100 test images), FL+HC's MNIST CNN (``cnn_briggs``, 600 images) and the MLP
(``mlp_fmnist``, 500 images); and, for a caller of ``evaluate_stacked`` that stacks more, 500 models
on 500 images at once. Random inputs and fresh models: a pass's time does not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fedcluster_flwr.engines import stacked  # noqa: E402
from fedcluster_flwr.models import build_model  # noqa: E402
from fedcluster_flwr.numerics import cpu_identity  # noqa: E402
from fedcluster_flwr.results.provenance import code_version  # noqa: E402

ONE_PASS = 1 << 62  # a pass size no slice reaches: every client of a slice in one pass
CASES = {  # name: (model, stacked models, samples per client)
    "dac_neighbour_losses": ("cnn_zec_fmnist", 8, 500),
    "dac_test": ("cnn_zec_fmnist", 8, 100),
    "flhc_cnn_briggs": ("cnn_briggs", 8, 600),
    "mlp_neighbour_losses": ("mlp_fmnist", 8, 500),
    "dac_neighbour_losses_500_models": ("cnn_zec_fmnist", 500, 500),
}


def evaluate(case: tuple[str, int, int], pass_samples: int) -> tuple[float, tuple[torch.Tensor, torch.Tensor]]:
    model, count, samples = case
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    models = [build_model(model, (1, 28, 28), 10) for _ in range(count)]
    data = [stacked.ClientBatchData(torch.randn(samples, 1, 28, 28, generator=generator),
                                    torch.randint(0, 10, (samples,), generator=generator)) for _ in range(count)]
    params = stacked.stack_parameters(models, torch.device("cpu"))
    before, stacked.CPU_PASS_SAMPLES = stacked.CPU_PASS_SAMPLES, pass_samples
    try:
        started = time.perf_counter()
        result = stacked.evaluation_sums(models[0], params, data, torch.device("cpu"))
        return time.perf_counter() - started, result
    finally:
        stacked.CPU_PASS_SAMPLES = before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(list(CASES)[:4]), help=f"comma-separated, of {', '.join(CASES)} "
                        "(default: all but the last)")
    parser.add_argument("--passes", default="128,512,1024", help="pass sizes (samples) to time against one pass")
    parser.add_argument("--repeat", type=int, default=5, help="alternations per pass size")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.cases.split(","):
        case = CASES[name]
        for pass_samples in (int(p) for p in args.passes.split(",")):
            one, grouped, same = [], [], True
            for _ in range(args.repeat):
                seconds, reference = evaluate(case, ONE_PASS)
                one.append(seconds)
                seconds, result = evaluate(case, pass_samples)
                grouped.append(seconds)
                same = same and all(torch.equal(a, b) for a, b in zip(reference, result))
            row = {"case": name, "model": case[0], "stacked_models": case[1], "samples": case[2],
                   "pass_samples": pass_samples, "one_pass_s": statistics.median(one),
                   "grouped_s": statistics.median(grouped),
                   "one_pass_over_grouped": statistics.median(a / b for a, b in zip(one, grouped)),
                   "same_bits": same}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpu": cpu_identity()[1], "capability": torch.backends.cpu.get_cpu_capability(),
                                        "code": code_version(), "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
