"""own_app: the ClientApp is fedcluster's, on this app's experiment (one Flower action per client task)."""

from pathlib import Path

from fedcluster_flwr.apps.client_app import FedclusterClientApp
from fedcluster_flwr.config.load import load_config
from fedcluster_flwr.experiment import Experiment

config, _ = load_config(Path(__file__).with_name("experiment.yaml"))
app = FedclusterClientApp(Experiment(config))
