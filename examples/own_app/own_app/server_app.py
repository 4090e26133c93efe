"""own_app: a ServerApp written as Flower's quickstart writes one, running a fedcluster strategy."""

from pathlib import Path

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from fedcluster_flwr.config.load import load_config
from fedcluster_flwr.experiment import Experiment

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""

    # Read run config
    num_rounds: int = context.run_config["num-server-rounds"]
    strategy_name: str = context.run_config["strategy"]
    out = Path(str(context.run_config["output-dir"])).expanduser() / f"run{context.run_id}"

    # The experiment the ClientApp trains on, with the strategy asked for
    yaml = Path(__file__).with_name("experiment.yaml")
    config, _ = load_config(yaml, [("strategy.name", strategy_name), ("rounds", num_rounds)])
    experiment = Experiment(config)

    # Load global model
    arrays = ArrayRecord(experiment.model().state_dict())

    # Initialize the strategy: fedcluster's (here FL+HC), its rounds recorded in `out`
    strategy = experiment.strategy(out)

    # Start strategy, run for `num_rounds`
    result = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=num_rounds)

    # The clusters it found, and where the run's files are
    print(f"clusters: {strategy.assignment.tolist()}; results in {out}")
    print(result)
