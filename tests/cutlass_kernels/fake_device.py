"""A CUDA device faked on the CPU for the launch path: device queries answered for an
architecture, and the compiled extension replaced by :class:`EmulatingExt`, which runs the CPU
emulation of exactly the arguments the binding receives."""

from __future__ import annotations

import types

import torch

from cutlass_kernels import build, reference, toolchain
from cutlass_kernels.epilogue import ACTIVATION_CODE
from cutlass_kernels.manifest import Arch, manifest


class EmulatingExt:
    """A stand-in for the compiled extension of ``arch``: ``instances()`` names the manifest's
    instances (or ``names``), ``tw_gemm`` emulates, with the instance's ``G`` and batch tile,
    exactly the arguments the binding receives, epilogue bias and activation included (the
    binding's and the launcher's checks included, see ``reference.check_launch``)."""

    def __init__(self, arch: Arch, names: list[str] | None = None) -> None:
        self.arch = arch
        self.names = names if names is not None else [k.name for k in manifest(arch)]
        self.calls: list[str] = []

    def instances(self) -> list[str]:
        return list(self.names)

    def tw_gemm(
        self,
        name,
        tile_meta,
        col_idx,
        row_idx,
        w,
        lda,
        xt,
        yt,
        batch,
        alpha,
        beta,
        bias,
        activation,
        stream,
    ):
        assert name in self.names
        kernel = next(k for k in manifest(self.arch) if k.name == name)
        widest = int(tile_meta[:, 1].max()) if tile_meta.numel() else 0
        pw = reference.TWPackedWeight(
            xt.shape[0], yt.shape[0], lda, widest, tile_meta, col_idx, row_idx, w
        )
        act = next(a for a, code in ACTIVATION_CODE.items() if code == activation)
        launch = reference.TWLaunch(pw, xt, yt, batch, batch, alpha, beta, bias, act)
        reference.emulate(launch, tile_m=kernel.tile_g, batch_tile=kernel.threadblock[1])
        self.calls.append(name)


def fake_device(
    monkeypatch, arch: Arch = Arch.SM90A, names: list[str] | None = None
) -> EmulatingExt:
    """CPU tensors treated as on a CUDA device of ``arch``; returns the extension stand-in."""
    ext = EmulatingExt(arch, names)
    monkeypatch.setattr(toolchain, "device_arch", lambda device=None: arch)
    monkeypatch.setattr(build, "default_extension", lambda arch=None: ext)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda d: types.SimpleNamespace(multi_processor_count=132),
    )
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda d=None: types.SimpleNamespace(cuda_stream=0)
    )
    return ext
