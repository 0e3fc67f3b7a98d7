"""Thin glue between :mod:`gepo_plugin.maths` and verl 0.9.x's public hooks.

Importing a submodule registers it with verl; the ``verl.plugins`` entry point imports
:mod:`gepo_plugin.verl_glue.plugin`, which imports them all in every verl process.
"""
