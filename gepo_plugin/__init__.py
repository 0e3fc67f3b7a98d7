"""gepo-plugin: GEPO (arXiv 2508.17850) and its family as verl policy losses, plus HeteroRL tools.

Importing this package is cheap and changes nothing in verl; verl loads the registrations
itself through the ``verl.plugins`` entry point (:mod:`gepo_plugin.entry_point`).
"""

__version__ = "0.1.0"
