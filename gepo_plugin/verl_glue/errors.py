"""The error every start-up check of the plugin's config raises."""

from gepo_plugin.options import OptionsError


class PluginConfigError(OptionsError):
    """A setting is impossible; the message names the key and says how to fix it."""
