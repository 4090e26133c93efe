"""The ``fedcluster`` command: ``console`` (the console script, stop signals first), ``commands``
(the subcommands), ``export`` (export-partitions), ``docs_reference`` (the generated reference
pages). Imports nothing, so that ``console`` starts before any heavy import."""
