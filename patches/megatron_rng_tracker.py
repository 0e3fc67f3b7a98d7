"""megatron-core's model-parallel RNG tracker on the CPU generator (the CPU backend's Megatron engine only).

megatron-core 0.16.1 ``tensor_parallel/random.py``: ``CudaRNGStatesTracker.add`` and ``.fork`` read and write the
CUDA generator (``torch.cuda.get_rng_state``, ``torch.cuda.default_generators``), and ``fork`` runs in every
attention forward. megatron's own no-op tracker (``initialize_rng_tracker(inference_rng_tracker=True)``) keeps no
states, and verl's Megatron checkpoint loader (``megatron_checkpoint_manager.py``, ``load_rng_states``) refuses
an empty tracker on resume. So install the same tracker on the CPU generator: ``add`` seeds a named state,
``fork`` runs the block with it (keeping its advance), and the inherited ``get_states``/``set_states`` feed verl's
checkpoint. It is installed before verl's ``set_random_seed`` -> ``model_parallel_cuda_manual_seed``, which keeps
an initialised tracker.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from gepo_plugin.patching import Patch
from gepo_plugin.verl_glue import seam

_RANDOM = "megatron.core.tensor_parallel.random"


def cpu_rng_tracker_class() -> type:
    """megatron's ``CudaRNGStatesTracker`` with ``add``/``fork`` on the CPU generator.

    It keeps the base class's bookkeeping (``states_``, ``seeds_``, ``_is_initialized``), which its inherited
    ``get_states``/``set_states``/``reset`` use.
    """
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker  # optional: megatron-core

    default_name = seam.resolve(f"{_RANDOM}._MODEL_PARALLEL_RNG_TRACKER_NAME")

    class CPURNGStatesTracker(CudaRNGStatesTracker):
        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextmanager
        def fork(self, name=default_name):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CPURNGStatesTracker


def _apply() -> None:
    seam.replace(f"{_RANDOM}._CUDA_RNG_STATE_TRACKER", cpu_rng_tracker_class()())
    seam.replace(f"{_RANDOM}._CUDA_RNG_STATE_TRACKER_INITIALIZED", True)


PATCH = Patch(
    name="megatron_rng_tracker",
    versions={"megatron-core": "==0.16.1"},
    reason="megatron's RNG tracker reads and writes the CUDA generator in every attention forward",
    apply=_apply,
    feature="megatron_cpu",
    check_contacts=seam.require,
)
