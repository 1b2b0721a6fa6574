"""Inside a training loop: gradients by parameter name, a monitor, dumps, NaN location, ranks.

``gradients`` (:func:`~gradaudit.training.gradients.collect_module`), ``monitor``
(:class:`~gradaudit.training.monitor.GradientMonitor`), ``dump``
(:func:`~gradaudit.training.dump.save_gradients`), ``locate``
(:class:`~gradaudit.training.locate.NanLocator`) and ``distributed`` (stats
across ranks, and the torchrun scan). The framework callbacks built on the
monitor are :mod:`gradaudit.integrations`.
"""

from typing import TYPE_CHECKING

from gradaudit import _submodules

if not TYPE_CHECKING:  # ``gradaudit.training.<module>`` without importing it first
    __getattr__ = _submodules(__name__)
