"""The algorithm families, one package each: its options (declared constraints), its server
strategy (a Flower ``Strategy`` subclass built on :mod:`.base`), its client tasks, its paper math
and its plots. A family registers its strategies and task handlers with
:mod:`fedcluster_flwr.registry` when it is imported; nothing lists the families, which
:func:`fedcluster_flwr.registry.load_families` finds (this package's subpackages, entry points,
``FEDCLUSTER_ALGORITHMS``).
"""
