"""On a mesh of one rank nothing moves: the whole model runs on local tensors, as plain PyTorch runs it. Its call
gathers every bucket once (one autograd node each, reducing as a block's does) and runs forward with no DTensor;
outputs come back as the DTensor path returns them. A checkpointed block makes it take the per-block path.
"""

from torch.distributed.tensor import DTensor, Replicate

from ..experts.dispatch import expert_modules
from ..parameters.reshard import CHECKPOINTED_ATTR
from .blocks import LocalBlock, whole_members
from .edges import from_local, map_tensors, to_local

__all__ = ["whole_model_members", "enter_local_model", "drop_local_model"]


def whole_model_members(model, state) -> tuple | None:
    """(parameters, buffers) of the whole model on a mesh of one rank, without experts or checkpointing; else None."""
    if (
        state.mesh.size() != 1
        or expert_modules(model)
        or any(getattr(m, CHECKPOINTED_ATTR, False) for m in model.modules())
    ):
        return None
    return whole_members(model.modules(), state.mesh)


def enter_local_model(state, model, name: str, args, kwargs):
    """(args, kwargs) on local tensors when the whole model runs locally (pushed on `state.local`); else None."""
    members = state.local_members.get(id(model))
    if members is None:
        return None
    call = LocalModel(state, model, name, members, (Replicate(),) * state.mesh.ndim)
    out = call.enter(args, kwargs)
    state.local.append(call)
    return out


def drop_local_model(model, state) -> None:
    """The model runs block by block from now on."""
    if state is not None:
        state.local_members.pop(id(model), None)


class LocalModel(LocalBlock):
    """One call of the whole model on local tensors."""

    def enter(self, args, kwargs):
        """Gathers every bucket and puts every parameter's local value in its module; returns the local inputs."""
        state = self.state
        values = {}
        # in the order forward uses them: the root unit's, then the blocks' (each prefetches the next)
        bucket = state.groups.get(id(self.module)) or next((b for b in state.groups.values() if b.prev is None), None)
        while bucket is not None:
            # on one rank no mesh axis splits the batch: each gradient comes back in its compute layout
            values.update(bucket.gather(state, [p._spmd_compute for p in bucket.params]))
            bucket = bucket.next
        self.place(values)
        return tuple(to_local(a) for a in args), {k: to_local(v) for k, v in kwargs.items()}

    def leave(self, output):
        """Drops the local values; a scalar output stays plain, any other tensor becomes a replicated DTensor."""
        self.drop_values()
        if self.state.outputs_local:
            return output
        mesh, layout = self.state.mesh, self.layout

        def wrap(t):
            if isinstance(t, DTensor) or t.ndim == 0:
                return t
            return from_local(t, mesh, layout, t.shape, t.stride())

        return map_tensors(output, wrap)
