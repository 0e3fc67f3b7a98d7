"""gepo-sampler: a sampler host that joins a gepo-plugin HeteroRL run by URL, and the wire it shares with the learner.

What runs beside a vLLM outside the learner's cluster, with nothing of the learner's stack (no verl, Ray, Hydra,
TransferQueue or Megatron): the sampler host (:mod:`gepo_sampler.host`), the weight relay's formats, store and
puller (:mod:`gepo_sampler.relay`), and the remote samplers' protocol (:mod:`gepo_sampler.remote`). The learner's
package, gepo-plugin, depends on this one and imports these modules from here, so both sides read one definition.
"""

__version__ = "0.1.0"
