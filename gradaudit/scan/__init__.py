"""Files or tensors in, a :class:`~gradaudit.results.Report` out.

``pending`` collects named tensors on the device (nothing read back) and reads
the files a scan is given; ``collected`` turns the rows, once on the host, into a
report, and ``judge`` the stats into findings and a report into an exit code, in
pure Python; ``torch_free`` scans safetensors files on the CPU without torch.
This ``__init__`` imports nothing: ``judge`` is on the CLI's start-up path,
which must not import torch.
"""

from typing import TYPE_CHECKING

from gradaudit import _submodules

if not TYPE_CHECKING:  # ``gradaudit.scan.<module>`` without importing it first
    __getattr__ = _submodules(__name__)
