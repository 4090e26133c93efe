"""Per-round trajectories of the shipped strategies on a small digits config, recorded once
and compared bit for bit after every refactor (``test_behaviour_preserved.py``). fedavg, local,
oracle and flhc were recorded before the protocol refactor; the strategies added with it were
recorded once they were in place (DAC's after its similarity-estimate refactor, checked
unchanged on a digits rotation run).

    python tests/trajectories.py   # re-record tests/fixtures/trajectories.json (only for an
                                   # intended behaviour change; say why in the commit)
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from conftest import DEFAULT_CONFIG  # noqa: E402
from inprocess import run_in_process  # noqa: E402

from fedcluster_flwr.config import load_config, parse_override  # noqa: E402

FIXTURE = HERE / "fixtures" / "trajectories.json"
# strategy -> its own overrides (the default config carries FL+HC's threshold, which one-shot HFL shares)
STRATEGY_OVERRIDES: dict[str, tuple[str, ...]] = {
    "fedavg": (), "local": (), "oracle": (), "flhc": (),
    "ifca": (), "gradloss": ("strategy.loss_reduction=mean", "strategy.lambda=0.5"),
    # amiri: the relevance rule this entry was recorded with (the paper's rule, now the default, sends no eigenvalues)
    "oneshot_hfl": ("strategy.threshold=null", "strategy.num_clusters=4", "strategy.shared_layers=[fc]",
                    "strategy.relevance=amiri"),
    "dac": ("strategy.num_neighbours=3",), "random_gossip": ("strategy.num_neighbours=3",),
}
STRATEGIES = tuple(STRATEGY_OVERRIDES)
# Client 3 fails in the clustering round (4) and client 17 joins late: FL+HC places both by
# training loss (train_select); client 5 fails in a FedAvg round.
SETTINGS = (
    "rounds=7",
    "strategy.rounds_before_clustering=3",
    "simulation.fail_fit={3: [4], 5: [2]}",
    "simulation.join_round={17: 6}",
)
KEYS = ("mean_client_accuracy", "mean_test_loss", "num_clusters", "fit_failures", "rejected_updates",
        "bytes_up", "bytes_down")


def trajectory(strategy_name: str) -> dict:
    overrides = [parse_override(o) for o in (*SETTINGS, f"strategy.name={strategy_name}", *STRATEGY_OVERRIDES[strategy_name])]
    config, _ = load_config(DEFAULT_CONFIG, overrides)
    with tempfile.TemporaryDirectory() as folder:
        strategy = run_in_process(config, Path(folder) / "run")
        rows = strategy.setup.recorder.rows
        return {
            "rounds": [{key: row[key] for key in KEYS} for row in rows],
            "assignment": [int(c) for c in strategy.assignment],
        }


if __name__ == "__main__":
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps({name: trajectory(name) for name in STRATEGIES}, indent=1) + "\n")
    print(f"wrote {FIXTURE}")
