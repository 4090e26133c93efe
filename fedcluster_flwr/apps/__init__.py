"""The Flower edges: the ClientApp (one Flower action per client task) and the ServerApp (one route
from its main to a strategy's ``start`` on whatever grid runs it). Flower's ``flwr run`` loads
``apps.server_app:app`` and ``apps.client_app:app``; ``fedcluster run`` and a user's own ServerApp
use the same two."""
