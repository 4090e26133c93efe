"""What a run leaves: its folder written as the rounds go by (recorder, round log, checkpoints,
tracking; the figures drawn with fedcluster_flwr.plots) and read back (run files, outcome lines).
Imports nothing: import the modules."""
