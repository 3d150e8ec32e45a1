"""The state of one parallelized model: its mesh, rules and dtypes, and what the pass keeps while it runs.

`parallelize` stores an `SPMDState` on the model (`STATE_ATTR`); the hooks push it while a module runs, so
`constrain` and checkpoint recomputation find the model's rules without being handed them.
"""

import contextlib
import enum

import torch

__all__ = [
    "STATE_ATTR",
    "MASTERS",
    "OFFLOADS",
    "Phase",
    "SPMDState",
    "depth",
    "unwind_to",
    "laid_out_parts",
    "active_state",
    "current_module",
    "activated",
    "push",
    "pop",
    "tracing",
]

STATE_ATTR = "_spmd_state"


MASTERS = ("params", "optimizer")  # where fp32 master weights live under a lower compute dtype
OFFLOADS = (None, "optimizer", "params")  # which states live in host memory instead of on the device (or "nvme:DIR")


class Phase(enum.Enum):
    """Where a step is. The root's hooks go idle -> forward -> backward (idle when nothing awaits backward); a
    checkpointed block recomputes in backward in `recompute`; shard_optimizer's step runs in `optimizer_step`."""

    IDLE = "idle"
    FORWARD = "forward"
    RECOMPUTE = "recompute"
    BACKWARD = "backward"
    OPTIMIZER_STEP = "optimizer step"


class SPMDState:
    def __init__(self, mesh, rules, param_dtype, reduce_dtype, input_axes, master="params", offload=None):
        if offload not in OFFLOADS and not (isinstance(offload, str) and len(offload) > 5 and offload[:5] == "nvme:"):
            raise ValueError(
                f"offload={offload!r} is not supported; use None, 'optimizer' (AdamW states and fp32 "
                f"masters in host memory, the step on the CPU), 'nvme:DIR' (them in files under DIR) or "
                f"'params' (stage-3 parameter shards too)"
            )
        if master not in MASTERS:
            raise ValueError(
                f"master={master!r} is not one of {MASTERS}: 'params' keeps fp32 parameters and casts "
                f"them for compute, 'optimizer' stores parameters in param_dtype and the fp32 master "
                f"with the optimizer states"
            )
        self.mesh, self.rules = mesh, rules
        self.param_dtype, self.reduce_dtype, self.master, self.offload = param_dtype, reduce_dtype, master, offload
        self.input_axes = input_axes
        self.phase = Phase.IDLE
        self.sync = True  # False under no_sync: gradients stay unreduced
        self.accumulating = False  # from no_sync to the end of the backward that syncs
        self.compiled_params: list = []  # parameters of compiled blocks (spmd.runtime.gradients.accumulate)
        self.decisions: dict[tuple, object] = {}  # (module, mesh axis) -> activations.Decision
        self.move_cache: dict = {}  # (id(input), layout) -> moved input, shared by sibling linears
        self.targets: dict = {}  # (what, axes or placements, shape) -> placements: fixed
        self.saved_hooks: list = []  # per running module: its reshard-after-forward hooks, or None
        self.shared_gathers: dict = {}  # gathered copies of parameters several modules hold
        self.groups: dict = {}  # id(block) -> the flat ParamGroup its parameters gather and reduce in
        self.group_of: dict = {}  # id(param) -> its flat ParamGroup
        self.singles: dict = {}  # id(param) -> its group of one, made at its first move (parameters.gather)
        self.reducer = None  # reducer.GradientReducer: bucket gradients reduced across blocks
        self.wire = None  # spmd.runtime.wire.Wire: the precision gathers and reductions travel in (comm=)
        self.local_members: dict = {}  # id(block) -> its (module, name, param): blocks that may run locally
        self.local: list = []  # the local.LocalBlock calls running now
        self.outputs_local = False  # the model hands out local tensors (a pipeline stage's, to torch's pipelining)
        self.global_view: list = []  # (module, GlobalView, phase before it) entered by the root or a recompute

    def target(self, key: tuple, decide):
        """The placements `decide()` gives for `key`, decided once; not kept while tracing (a guard on the map)."""
        if tracing():
            return decide()
        hit = self.targets.get(key)
        if hit is None:
            if len(self.targets) >= 1024:  # shapes that vary (sequence lengths) would otherwise grow it without end
                self.targets.clear()
            hit = self.targets[key] = tuple(decide())
        return hit


def tracing() -> bool:
    """Whether the compiler traces this call: then nothing is cached, pushed or tagged. The one place that asks."""
    return torch.compiler.is_compiling()


_active: list[tuple] = []  # (SPMDState, module name) of each running call, innermost last
# the top state, read under the compiler: a guard on it holds in forward and recompute alike (a depth would not)
_top: SPMDState | None = None


def laid_out_parts(model, needs: str) -> list:
    """[(module, SPMDState)] that make up `model`: itself, or a pipeline's stages; `needs` names the caller."""
    state = getattr(model, STATE_ATTR, None)
    if state is not None:
        return [(model, state)]
    parts = [(m, getattr(m, STATE_ATTR, None)) for m in getattr(model, "laid_out_parts", ())]
    if not parts or any(st is None for _, st in parts):
        raise ValueError(
            f"{needs} needs a model laid out by spmd.parallelize (or a pipeline from "
            f"spmd.build_pipeline); call it after laying the model out"
        )
    return parts


def active_state() -> SPMDState | None:
    return _top


def current_module() -> str:
    """The innermost running module's name; "" under the compiler (a graph serves every block of a type)."""
    return "" if tracing() or not _active else _active[-1][1]  # (tracing first: no guard on the stack)


def _set_top():
    global _top
    _top = _active[-1][0] if _active else None


def push(state: SPMDState, module: str | None = None):
    """`state` for `module`'s call (default: the running module's, as a checkpointed block's recompute)."""
    if not tracing():  # a compiled block runs inside the root's or its recompute's push
        _active.append((state, current_module() if module is None else module))
        _set_top()


def depth() -> int:
    return len(_active)


def unwind_to(n: int) -> None:
    """Pops the states pushed beyond depth `n` (calls whose hooks did not pop them: a forward that raised)."""
    del _active[n:]
    _set_top()


def pop():
    if not tracing() and _active:
        unwind_to(len(_active) - 1)


@contextlib.contextmanager
def activated(state: SPMDState | None):
    """Makes `state` the one `constrain` sees (recomputation under checkpointing runs outside the hooks)."""
    if state is None:
        yield
        return
    push(state)
    try:
        yield
    finally:
        pop()
