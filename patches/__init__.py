"""Patches to verl that its public hooks cannot express; installed as ``gepo_plugin.patches``.

Each module defines one :class:`gepo_plugin.patching.Patch` named ``PATCH``; the CPU backend
applies them (see ``gepo_plugin.cpu_backend.activate``). See README.md here for the list.
"""
