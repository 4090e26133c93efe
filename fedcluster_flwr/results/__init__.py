"""What a run leaves: its folder written as the rounds go by (recorder, round log, checkpoints,
plots, tracking) and read back (run files, outcome lines). Imports nothing: import the modules."""
