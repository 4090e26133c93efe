"""The experiment config: read (``load``: a YAML file and dotted overrides -> a typed, checked
:class:`~fedcluster_flwr.config.sections.ExperimentConfig`), its sections declared (``sections``, with
:mod:`fedcluster_flwr.declarations`' ``option()`` and roles), its file read safely (``file``) and its
cost estimated (``cost``). It sits above the datasets, models, training settings and strategies whose
options it gathers; how an option is declared is below them all (:mod:`fedcluster_flwr.declarations`).

Nothing is imported here: the modules are imported by name.
"""
