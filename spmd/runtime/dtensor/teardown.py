"""Work that must end before the process group goes (a checkpoint save in flight): `install()` wraps
`destroy_process_group` so it, and the interpreter's exit, first run each callback `before_destroy` registered;
the first error is raised after the groups are gone (at exit: printed, exit status 1).
"""

import atexit
import functools
import os
import sys

import torch.distributed as dist

__all__ = ["before_destroy", "install"]

_CALLBACKS: list = []  # (finish: () -> [errors], release: () -> None, who names the errors)


def before_destroy(finish, release, who: str) -> None:
    """Runs `finish` before the world is destroyed or the interpreter exits, `release` (drop the groups) after."""
    if all(f is not finish for f, _, _ in _CALLBACKS):
        _CALLBACKS.append((finish, release, who))


def _finish_and_release(destroy=None) -> list:
    errors = [(e, who) for finish, _, who in list(_CALLBACKS) for e in finish()]
    if destroy is not None:
        destroy()
    for _, release, _ in list(_CALLBACKS):
        release()
    return errors


def install() -> None:
    """Makes `destroy_process_group()` and the interpreter's exit wait for the registered work (idempotent)."""
    destroy = dist.destroy_process_group
    if getattr(destroy, "_finishes_work", False):
        return

    @functools.wraps(destroy)
    def destroy_process_group(group=None):
        if group is not None and group is not dist.GroupMember.WORLD:
            return destroy(group)
        errors = _finish_and_release(functools.partial(destroy, group))
        if errors:
            raise errors[0][0]

    destroy_process_group._finishes_work = True
    dist.destroy_process_group = dist.distributed_c10d.destroy_process_group = destroy_process_group
    atexit.register(_at_exit)


def _at_exit() -> None:
    errors = _finish_and_release()
    if errors:
        print(f"{errors[0][1]}: {errors[0][0]}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
