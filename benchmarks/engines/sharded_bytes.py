"""What the batched engine over Ray actors really sends per round (issue #57), against what the round
rows count (benchmarks/engines/README.md, "The batched engine over Ray actors").

The round rows' ``bytes_down`` / ``bytes_eval`` / ``bytes_up`` count every client's arrays, one copy
per client, as Flower's Ray engine sends them. A sharded grid hands each actor its shard's messages in
one call, pickled together: an array object that several of the shard's messages hold (FL+HC's
evaluation model, the same for every client; a DAC client's model that several of its neighbours
get) is pickled once per shard, as pickle keeps one copy of an object it has already written. This
script runs a conf on ``--actors`` actors and records, per exchange, the bytes of each shard's call
as Ray pickles it (``ray.cloudpickle``, protocol 5), the bytes of the same messages pickled one by
one, and the bytes of the replies::

    python benchmarks/engines/sharded_bytes.py conf/dac_fmnist_rot4.yaml --rounds 2 --actors 2 \
        --out benchmarks/engines/results/sharded_bytes_dac_full.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fedcluster_flwr.apps.server_app import run_in_process  # noqa: E402
from fedcluster_flwr.config.load import load_config, parse_override  # noqa: E402
from fedcluster_flwr.declarations.schema import ConfigError  # noqa: E402
from fedcluster_flwr.engines import sharded  # noqa: E402


def measured_deliver(exchanges: list[dict]):
    """ShardedGrid.deliver, recording what each of its calls pickles."""
    import ray.cloudpickle as pickle

    deliver = sharded.ShardedGrid.deliver

    def recorded(self, messages):
        replies = deliver(self, messages)
        exchanges.append({
            "message_type": messages[0].metadata.message_type if messages else None,
            "messages": len(messages),
            "sent_per_shard": {k: len(pickle.dumps([messages[i] for i in indices], protocol=5))
                               for k, indices in sorted(self.by_shard(messages).items())},
            "sent_one_by_one": sum(len(pickle.dumps(m, protocol=5)) for m in messages),
            "replies": sum(len(pickle.dumps(r, protocol=5)) for r in replies),
        })
        return replies

    return recorded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("conf", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], help="more overrides, key=value")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    overrides = ["simulation.engine=batched", f"simulation.batched_actors={args.actors}", f"rounds={args.rounds}",
                 *args.set]
    try:
        config, _ = load_config(args.conf, [parse_override(o) for o in overrides])
    except ConfigError as err:
        parser.error(str(err))
    exchanges: list[dict] = []
    sharded.ShardedGrid.deliver = measured_deliver(exchanges)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        run_in_process(config, Path(tmp) / "run")
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "rounds.jsonl").read_text().splitlines()]
    result = {"conf": str(args.conf), "overrides": overrides, "actors": args.actors,
              "wall_seconds": time.perf_counter() - started, "exchanges": exchanges,
              "round_rows": [{k: r[k] for k in ("round", "phase", "bytes_down", "bytes_eval", "bytes_up")}
                             for r in rows]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for exchange in exchanges:
        sent = sum(exchange["sent_per_shard"].values())
        print(f"{exchange['message_type']:>16}: {exchange['messages']:3d} messages, sent {sent / 1e6:8.2f} MB "
              f"(one by one: {exchange['sent_one_by_one'] / 1e6:8.2f} MB), replies {exchange['replies'] / 1e6:8.2f} MB")
    for row in result["round_rows"]:
        print(f"round {row['round']} ({row['phase']}): rows count down {row['bytes_down'] / 1e6:.2f} MB, "
              f"eval {row['bytes_eval'] / 1e6:.2f} MB, up {row['bytes_up'] / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
