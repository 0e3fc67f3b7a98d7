"""The plugin's Hydra config: ``gepo_trainer.yaml`` (verl's ``ppo_trainer`` plus the plugin's keys).

The plugin's option blocks are not written out in the yaml: their nodes are built here from the typed models
that define them (:mod:`gepo_plugin.maths.options`, :mod:`gepo_plugin.hetero.settings`) and registered in Hydra's
``ConfigStore``, so each default exists in exactly one place and ``--cfg job`` shows it.
"""

from hydra.core.config_store import ConfigStore

from gepo_plugin.hetero.settings import HeteroConfig
from gepo_plugin.maths.options import BNPOOptions, DeltaLOptions, PolicyLossOptions
from gepo_plugin.options import defaults_of

#: ``_target_`` verl instantiates for ``actor_rollout_ref.actor.policy_loss`` (verl's config plus GEPO's options).
POLICY_LOSS_TARGET = "gepo_plugin.verl_glue.config.GEPOPolicyLossConfig"

#: ConfigStore name -> the node (the yaml's defaults list places each one).
NODES = {
    "gepo_policy_loss": {"_target_": POLICY_LOSS_TARGET, **defaults_of(PolicyLossOptions)},
    "gepo_bnpo": defaults_of(BNPOOptions),
    "gepo_delta_l": defaults_of(DeltaLOptions),
    "gepo_hetero": defaults_of(HeteroConfig),
}


def register_nodes() -> None:
    store = ConfigStore.instance()
    for name, node in NODES.items():
        store.store(name=name, node=node)


register_nodes()
