"""Host-memory advice for the large, randomly read arrays of the parameter server.

A cache's rows (hundreds of MiB) are read at random: with 4 KiB pages nearly every row read is
also a TLB miss and a page walk. :func:`huge_zeros` allocates such an array, asks the kernel to
back it with transparent huge pages (``madvise(MADV_HUGEPAGE)``: honoured when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``, the common
defaults), and only then touches it, so it is faulted in 2 MiB pages. Elsewhere (another OS, a
CUDA tensor, a small array) it is plain ``torch.zeros``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

import torch

__all__ = ["HUGE_PAGE", "huge_zeros"]

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # bytes: x86-64 and arm64 transparent huge page size
_MADV_HUGEPAGE = 14  # linux/mman.h


@functools.lru_cache(maxsize=1)
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape, dtype)`` on ``device``; on a Linux CPU and at least 4 huge pages,
    backed by transparent huge pages where the kernel grants them."""
    t = torch.empty(shape, dtype=dtype, device=device)
    nbytes = t.numel() * t.element_size()
    fn = _madvise() if device.type == "cpu" and nbytes >= 4 * HUGE_PAGE else None
    if fn is not None:
        start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # the huge pages inside the block
        end = (t.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start and fn(start, end - start, _MADV_HUGEPAGE) != 0:
            log.debug("madvise(MADV_HUGEPAGE) refused (errno %d)", ctypes.get_errno())
    return t.zero_()
