"""verl plugin entry point (group ``verl.plugins``): runs on ``import verl`` in every process, cheaply.

It imports nothing of verl's trainer stack. It only

1. warns once if the installed verl is not a version the plugin's private contacts were tested with
   (:func:`gepo_plugin.verl_glue.seam.warn_if_untested`);
2. arranges the plugin's registrations to happen when verl imports the registries they go into
   (:mod:`gepo_plugin.verl_glue.registration`), so every lookup finds them, in any import order;
3. under ``VERL_PLATFORM=cpu`` only, does the same for the CPU backend (:mod:`gepo_plugin.cpu_backend.activate`).

verl swallows plugin import errors at DEBUG level, so each step logs a WARNING naming what failed instead of
raising; ``python -m gepo_plugin doctor`` shows the state here and in a fresh Ray actor.
"""

from gepo_plugin.cpu_backend.activate import install_if_selected
from gepo_plugin.verl_glue import registration, seam

seam.warn_if_untested()
registration.install()
install_if_selected()
