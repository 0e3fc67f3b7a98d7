"""The relay's store, checked before Ray starts: a run that cannot publish stops at once, with the URL and the fix."""

from __future__ import annotations

from gepo_plugin.hetero.settings import HeteroSettings
from gepo_plugin.verl_glue.errors import PluginConfigError
from gepo_sampler.relay.store import RelayStoreError, open_store


def check_relay_store(hetero: HeteroSettings, inspecting: bool = False) -> list[str]:
    """With ``hetero.transport=relay``: the secret's variable is set and the learner can write the run's store.

    ``inspecting`` (the config is only printed): nothing is probed (a cluster's bucket is often out of a laptop's
    reach); a warning says the run will probe it.
    """
    relay = hetero.relay
    if not hetero.enable or relay is None:
        return []
    if inspecting:
        return [f"hetero.relay.url={relay.url!r} is not probed while printing: a run writes a probe object there first"]
    try:
        relay.secret()
        open_store(relay).probe(write=True)
    except (RelayStoreError, RuntimeError) as error:
        raise PluginConfigError(str(error)) from None
    return []
