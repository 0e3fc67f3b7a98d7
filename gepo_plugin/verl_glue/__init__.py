"""Thin glue between :mod:`gepo_plugin.maths` and verl 0.9.x's public hooks.

Importing ``losses``, ``advantages`` or ``trainers`` registers their names with verl; the ``verl.plugins``
entry point (:mod:`gepo_plugin.entry_point`) arranges that through :mod:`gepo_plugin.verl_glue.registration`
as soon as verl imports the registries. Every use of a private verl name goes through
:mod:`gepo_plugin.verl_glue.seam`.
"""
