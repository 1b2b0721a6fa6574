"""The device side: tensors in, stats rows out, read back to the host once.

``stats`` holds the collector that buckets and chunks tensors and the one host
read (the row's slots and merge rule are :mod:`gradaudit.results.row`), ``dtypes``
which dtypes are audited; the kernels that compute a row are ``kernels`` (eager and
``torch.compile``), ``native`` (the C kernel in ``_native.c``) and ``triton_kernel``
(``_triton_rows``); ``staging`` overlaps host-to-device copies, ``devices`` resolves
``--device``, ``histogram`` is the opt-in exponent histogram. ``options`` and
``native_rows`` (the native kernel's host side) need no torch: the CLI declares
``--engine`` and ``--max-memory`` with ``options`` at start-up, and the torch-free scan
(:mod:`gradaudit.scan.torch_free`) uses ``native_rows``, so this ``__init__`` imports
nothing.
"""

from typing import TYPE_CHECKING

from gradaudit import _submodules

if not TYPE_CHECKING:  # ``gradaudit.engine.<module>`` without importing it first
    __getattr__ = _submodules(__name__)
