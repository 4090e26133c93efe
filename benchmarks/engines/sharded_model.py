"""The batched engine over Ray actors (issue #57): from one side-by-side measurement on this machine,
the round time predicted on a cluster of 4, 16 and 64 such nodes (benchmarks/engines/README.md).

    python benchmarks/engines/run.py rounds --confs dac_fmnist_rot4 --rounds 2 --tag sharded_dac_full \
        --engines batched,batched@2,ray --set ...        # see the README for the exact command
    python benchmarks/engines/sharded_model.py results/sharded_dac_full.jsonl results/sharded_dac_full_1worker.jsonl

The model, for one exchange round of N clients on P nodes of c cores each:

    T(P) = S + B·o + B / bw + (W / (P·c)) · g(N / (P·c))

* ``W`` (core-seconds of client work per round) and ``S`` (the serial rest: the server's aggregation,
  scoring, records and the engine's own bookkeeping) from two single-process ``batched`` rounds on
  this machine's c cores, with c workers (T_c = S + W/c) and with one (T_1 = S + W):
  W = (T_1 - T_c)·c/(c-1), S = T_c - W/c. Where that gives S < 0 (the round more than c times as
  fast on c workers: S is below the measurement's noise), S = 0 and W = c·T_c, and the prediction
  is a lower bound by the unresolved serial part.
* ``o`` (seconds per byte of the round's messages, pickled, sent through Ray's object store and
  unpickled): (T_actors - T_c) / B, from the same round over c one-core actors on this machine, whose
  client work is the same W on the same c cores; an upper bound, as it also holds Ray's own
  per-call costs. The driver pickles every message, so this part does not shrink with P.
* ``B`` (bytes per round): the round rows' ``bytes_down + bytes_up + bytes_eval``, one copy per
  client, an upper bound on what the actors are sent (a model several of a shard's messages carry
  is pickled once per shard: ``sharded_bytes.py``); ``bw`` the driver's network, assumed 1.1 GB/s
  (10 Gb/s Ethernet).
* ``g(k)``: the per-client cost at k clients per worker relative to a full stack. At 8 or more
  clients a worker's stack runs at the stacked cost; one client alone costs ``ALONE_OVER_STACKED``
  times as much (cnn_zec_fmnist on this CPU: 7.05 ms alone against 2.45 ms stacked per client-step,
  benchmarks/engines/README.md); in between, linear. Below one client per worker the extra workers
  idle: g(k) = ALONE_OVER_STACKED / k.

Assumed: identical nodes, shards of equal work, nothing else on the machines, the server side as
here (it does not grow with P), and no straggler.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

BANDWIDTH = 1.1e9  # bytes per second: 10 Gb/s Ethernet, what the driver's link carries
ALONE_OVER_STACKED = 7.05 / 2.45
FULL_STACK = 8  # clients per worker from which a stack runs at the stacked cost


def stack_factor(clients_per_worker: float) -> float:
    if clients_per_worker >= FULL_STACK:
        return 1.0
    if clients_per_worker >= 1:
        return 1 + (ALONE_OVER_STACKED - 1) * (FULL_STACK - clients_per_worker) / (FULL_STACK - 1)
    return ALONE_OVER_STACKED / clients_per_worker


def exchange_round(rows: list[dict], engine: str) -> float:
    """The exchange round (the second) of ``engine``'s runs, median over repetitions."""
    return statistics.median(r["round_seconds"][1] for r in rows if r["engine"] == engine and "error" not in r)


def predict(t_cores: float, t_one: float, t_actors: float, cores: int, bytes_per_round: float, clients: int,
            nodes: tuple[int, ...] = (4, 16, 64)) -> dict:
    work = (t_one - t_cores) * cores / (cores - 1)
    serial = t_cores - work / cores
    resolved = serial >= 0
    if not resolved:  # more than c times faster on c workers: the serial part is below the noise; bound it by 0
        serial, work = 0.0, t_cores * cores
    per_byte = max(0.0, (t_actors - t_cores) / bytes_per_round)
    predicted = {}
    for p in nodes:
        workers = p * cores
        predicted[p] = serial + bytes_per_round * per_byte + bytes_per_round / BANDWIDTH + \
            work / workers * stack_factor(clients / workers)
    return {"work_core_s": work, "serial_s": serial, "serial_resolved": resolved, "s_per_byte": per_byte,
            "bytes": bytes_per_round, "predicted_round_s": predicted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("measured", type=Path, help="rows of batched, batched@<cores> (and ray) on this machine")
    parser.add_argument("one_worker", type=Path, help="rows of batched with simulation.batched_workers=1")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--bytes", type=float, default=136_728_000 + 22_788_000 + 22_788_000,
                        help="per exchange round (default: full-scale DAC's, from its committed rows)")
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.measured.read_text().splitlines() if line.strip()]
    one = [json.loads(line) for line in args.one_worker.read_text().splitlines() if line.strip()]
    t_cores, t_actors = exchange_round(rows, "batched"), exchange_round(rows, f"batched@{args.cores}")
    t_one = exchange_round(one, "batched")
    print(json.dumps({"t_batched": t_cores, "t_batched_1_worker": t_one, f"t_batched@{args.cores}": t_actors}
                     | predict(t_cores, t_one, t_actors, args.cores, args.bytes, args.clients), indent=1))


if __name__ == "__main__":
    main()
