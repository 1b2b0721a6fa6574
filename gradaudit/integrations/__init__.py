"""Adapters between :class:`~gradaudit.GradientMonitor` and the tools training runs live in.

Each framework adapter is its own module and imports its framework when *it* is imported,
never before: ``import gradaudit`` (and this package) pull in none of them.

* :mod:`gradaudit.integrations.hf`: a ``transformers`` ``TrainerCallback``
  (``pip install 'gradaudit[transformers]'``);
* :mod:`gradaudit.integrations.lightning`: a Lightning ``Callback``
  (``pip install 'gradaudit[lightning]'``);
* :mod:`gradaudit.integrations.accelerate`: :func:`accelerate_step` for Accelerate loops
  (synchronised steps only, fp16 gradients unscaled first; imports nothing);
* :mod:`gradaudit.integrations.loggers`: monitor records to TensorBoard
  (``[tensorboard]``) or Weights & Biases (``[wandb]``) through one small interface;
* :mod:`gradaudit.integrations.scalars`: the one place that turns a record into the
  scalars every adapter logs (no dependency).
"""

from __future__ import annotations
