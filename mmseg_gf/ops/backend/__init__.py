"""What every operator's implementations share: the switches, the compiled
extensions' loader, their output pool and toggles, the Triton runtime, the
device stand-in and the dispatcher. Importing it binds the compiled
toggles to :mod:`.switches` (:func:`~.switches.override`)."""
from . import cpu_settings, output_pool  # noqa: F401  (binds the toggles)
