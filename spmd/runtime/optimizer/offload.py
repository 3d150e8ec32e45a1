"""Where offloaded optimizer state lives: host memory (`offload="optimizer"`) or files (`offload="nvme:DIR"`).

`host_copy`: pinned memory with CUDA, or a memory-mapped file the OS pages in and out, so a state larger than host
memory still trains. `file_backed_adam_state` puts Adam's moments in files before the first step;
`release_pages` drops a file-backed tensor's pages after its update, so the step streams one parameter at a time.
"""

import ctypes
import mmap
import os

import torch

from ..dtensor.wrap import local_of, wrap_local
from ..parameters.host import host_tensor

__all__ = ["nvme_dir", "host_copy", "file_backed_adam_state", "file_backed", "release_pages"]


def nvme_dir(offload) -> str | None:
    return offload[len("nvme:") :] if isinstance(offload, str) and offload.startswith("nvme:") else None


def _file_tensor(directory: str, name: str, like: torch.Tensor) -> torch.Tensor:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    path = os.path.join(directory, f"rank{rank:05d}", name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:  # a fresh file of zeros, sized for the tensor
        f.truncate(like.nbytes)
    return torch.from_file(path, shared=True, size=like.numel(), dtype=like.dtype).view(like.shape)


def host_copy(local: torch.Tensor, offload, name: str) -> torch.Tensor:
    """A copy of `local` in host memory (pinned with CUDA) or, under nvme:DIR, in a memory-mapped file."""
    directory = nvme_dir(offload)
    if directory is None:
        return host_tensor(local)
    if isinstance(local, torch._subclasses.FakeTensor):  # explain: nothing to write
        return local.to("cpu", copy=True)
    return _file_tensor(directory, f"{name}.master", local).copy_(local)


def file_backed_adam_state(opt: torch.optim.Optimizer, masters, directory: str) -> None:
    """Adam/AdamW moments of `masters` in files under `directory`, made as the optimizer would (zeros, step 0)."""
    if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(
            f"offload='nvme:DIR' keeps Adam/AdamW moments in files; {type(opt).__name__} is not "
            f"supported: use torch.optim.AdamW, or offload='optimizer'"
        )
    for m in masters:
        local = local_of(m)
        state = {"step": torch.zeros((), dtype=torch.float32)}
        for key in ("exp_avg", "exp_avg_sq"):
            t = _file_tensor(directory, f"{m._spmd_name}.{key}", local)
            state[key] = wrap_local(t, m.device_mesh, m.placements, m.shape, m.stride())
        opt.state[m] = state


def file_backed(t: torch.Tensor) -> bool:
    """Whether `t` (or a DTensor's local shard) lives in a memory-mapped file (offload="nvme:DIR")."""
    return local_of(t).untyped_storage().filename is not None


_libc = ctypes.CDLL(None, use_errno=True) if hasattr(mmap, "MADV_DONTNEED") else None


def release_pages(tensors) -> None:
    """Drops the resident pages of each file-backed tensor (madvise DONTNEED: dirty pages stay in the file)."""
    for t in tensors:
        storage = local_of(t).untyped_storage()
        if _libc is None or not file_backed(t) or storage.nbytes() == 0:
            continue
        if (
            _libc.madvise(ctypes.c_void_p(storage.data_ptr()), ctypes.c_size_t(storage.nbytes()), mmap.MADV_DONTNEED)
            != 0
        ):
            raise OSError(ctypes.get_errno(), f"madvise(MADV_DONTNEED) failed on {storage.filename}")
