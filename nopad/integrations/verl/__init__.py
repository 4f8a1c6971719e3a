"""One line to run verl's own calls on nopad: ``nopad.integrations.verl.install()``.

``install()`` rebinds, in verl's modules only, the names verl uses for its padding and THD
conversions, its row utilities (mini-batches, micro-batches, the join and restore of outputs,
balanced partitions) and the torch path of its fused output head, wherever verl bound them (those
imported already, and those imported later through an import hook of its own). Each replacement
has verl's signature and gives verl's results; options nopad does not implement fall through to
verl's own function. The returned :class:`VerlPatch` undoes it (``uninstall()``, or use it as a
context manager). See docs/integrations/verl.md for the list.
"""

from nopad.integrations.verl._install import VerlPatch, install

__all__ = ["VerlPatch", "install"]
