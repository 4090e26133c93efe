"""How an option is declared, below everything that declares one: what a valid value is
(``schema``: ``option()``, constraints, class rules, :class:`~fedcluster_flwr.declarations.schema.ConfigError`),
what else the option is (``roles``), and how declared dataclasses are built from mappings and check
themselves (``options``: ``from_mapping``, ``DeclaredOptions``). The experiment config
(:mod:`fedcluster_flwr.config`), the training settings, the partitioners and the strategies declare
their options with these; nothing here imports from the rest of the package.
"""
