"""A Flower app of one's own that runs a fedcluster strategy (docs/how-to/own-app.md)."""
