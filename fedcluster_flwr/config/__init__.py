"""The experiment config: read (``load``: a YAML file and dotted overrides -> a typed, checked
:class:`~fedcluster_flwr.config.sections.ExperimentConfig`), declared (``sections``; what a valid
value is, ``schema``; what else an option is, ``roles``), built (``options``: mappings -> declared
dataclasses), its file read safely (``file``) and its cost estimated (``cost``).

Nothing is imported here: the modules below are imported by name (the training code imports the
declarations without the loader, which needs the datasets, the models and the strategies).
"""
