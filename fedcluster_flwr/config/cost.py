"""What a run will cost, from its config alone, before anything starts.

The unit is the *client-sample pass*: one training sample through one client's model, forward and
backward, once. A run costs about

    rounds x clients that train per round x client.epochs x training samples per client

(plus, for the gossip strategies, every client's ``pretrain_epochs`` in round 1), where the clients
per round are ``strategy.client_fraction`` of ``partition.num_clients``, at least one (all of them
for a strategy without one) and the samples per client are ``partition.samples_per_client`` (else an equal share
of the dataset) less the test and validation shares. Evaluation, clustering and communication
come on top; they grow with the same factors but epochs. ``fedcluster run --dry-run`` prints the
estimate; past :data:`WARN_PASSES` every command that loads the config warns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .sections import ExperimentConfig

# Samples of each dataset's pool (train and test files together), which the partitions share out.
POOL_SIZES = {"digits": 1797, "mnist": 70_000, "fashion_mnist": 70_000, "cifar10": 60_000, "femnist": 805_263}

# conf/default.yaml (FL+HC on digits, 30 rounds, 6 of 20 clients a round, 2 epochs, ~72 samples of
# which 80 % train): about 30 s on 2 CPU cores. tests/test_hostile_config.py checks the number.
DEFAULT_CONFIG_PASSES = 25_877
# A hundred times the largest paper table here (DAC's, about 1e7 passes): a day and more of CPU.
WARN_PASSES = 1e9


@dataclass(frozen=True)
class CostEstimate:
    rounds: int
    clients_per_round: int
    epochs: int
    samples_per_client: float  # training samples, about
    pretrain_passes: float  # round 1's pretraining of every client (gossip strategies), beside the rest

    @property
    def passes(self) -> float:
        return self.rounds * self.clients_per_round * self.epochs * self.samples_per_client + self.pretrain_passes

    @property
    def too_costly(self) -> bool:
        return self.passes > WARN_PASSES

    def text(self) -> str:
        """One line: the total, its factors (with their keys) and how it compares with the default config."""
        pretrain = f" + {self.pretrain_passes:.3g} pretraining (strategy.pretrain_epochs)" if self.pretrain_passes else ""
        return (
            f"about {self.passes:.3g} client-sample passes: rounds {self.rounds} x {self.clients_per_round} "
            f"clients a round (partition.num_clients, strategy.client_fraction) x client.epochs {self.epochs} "
            f"x ~{self.samples_per_client:.0f} training samples per client{pretrain}; "
            f"{self.passes / DEFAULT_CONFIG_PASSES:.3g} times conf/default.yaml (about 30 s on 2 CPU cores)"
        )


def estimate_cost(config: ExperimentConfig) -> CostEstimate:
    """The client-sample passes ``config`` will train, from its options alone (no data is read)."""
    clients = config.partition.num_clients
    options = config.strategy.options
    fraction = getattr(options, "client_fraction", None)
    per_round = clients if fraction is None else max(1, math.floor(fraction * clients + 1e-9))  # as sample() draws
    pool = POOL_SIZES.get(config.dataset.name)
    share = config.partition.samples_per_client or (pool / clients if pool else 0)
    training = share * (1.0 - config.partition.test_fraction - config.partition.val_fraction)
    pretrain = getattr(options, "pretrain_epochs", 0)
    pretrain = config.client.epochs if pretrain is None else pretrain  # null: client.epochs
    return CostEstimate(config.rounds, per_round, config.client.epochs, training, clients * pretrain * training)
