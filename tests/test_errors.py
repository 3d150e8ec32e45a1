"""Bad input fails fast with an error that names the problem and the fix, on every rank, before any
collective: the multi-process cases count collectives with torch's CommDebugMode around each failing
call, and run under a timeout, so a rank left waiting in a collective fails the test instead of hanging
it. Ranks that disagree (a different mesh or different rules on one rank) fail on every rank after one
agreement exchange, before any collective of the layout."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor.debug import CommDebugMode

import spmd
from tests.dist_utils import run_distributed
from tests.spmd_cases import tiny_model


def test_spec_strings_reject_repeated_and_unknown_axes():
    with pytest.raises(ValueError, match="'fsdp' appears twice"):
        spmd.parse_spec("fsdp=2,fsdp=2")
    with pytest.raises(ValueError, match="unknown mesh axis 'fsd'.*allowed axes"):
        spmd.parse_spec("fsd=2")
    with pytest.raises(ValueError, match="unknown flag 'spp'"):
        spmd.parse_spec("tp=2,spp")


def test_rule_with_a_typo_names_the_axis_and_suggests_the_fix():
    with pytest.raises(ValueError, match="'fdsp'.*did you mean 'fsdp'"):
        spmd.Rules({"batch": "fdsp"})
    with pytest.raises(ValueError, match="more than once"):
        spmd.Rules({"batch": ("dp", "dp")})
    # known axes absent from a mesh are fine: one table serves every mesh
    spmd.Rules({"batch": ("dp", "fsdp"), "mlp": "tp"})


def test_constrain_checks_the_number_of_axes_even_on_one_device():
    with pytest.raises(ValueError, match="constrain got 1 axes .* 2 dims"):
        spmd.constrain(torch.zeros(2, 3), "batch")
    x = torch.zeros(2, 3)
    assert spmd.constrain(x, "batch", "embed") is x


def test_annotate_checks_the_number_of_axes():
    with pytest.raises(ValueError, match="annotate got 1 axes"):
        spmd.annotate(torch.zeros(2, 3), "embed")
    with pytest.raises(ValueError, match="has 1 entries"):
        spmd.annotate(torch.zeros(2, 3), spmd.P("tp"))
    with pytest.raises(ValueError, match="matches no parameter"):
        spmd.annotate_by_name(nn.Linear(2, 2), {"*.q_proj.weight": ("heads", "embed")})


class Unannotated(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)


class Clash(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)
        spmd.annotate(self.proj.weight, "mlp", "heads")  # both map to tp


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3, bias=False)
        spmd.annotate(self.proj.weight, "mlp", "embed")


def _raises_after(fn, pattern, collectives: dict):
    """fn raises ValueError matching `pattern` after exactly these collectives ({kind: count}) ran."""
    with CommDebugMode() as comm:
        with pytest.raises(ValueError, match=pattern):
            fn()
    ran = {op.__name__: n for op, n in comm.get_comm_counts().items() if n}
    assert ran == collectives, f"{pattern!r}: collectives before the error {ran}, expected {collectives}"


def _every_rank_raises(rank, world):
    def expect(fn, pattern):
        _raises_after(fn, pattern, {})

    expect(lambda: spmd.make_mesh({"fsdp": 4}), "has 4 devices but the world size is 2")
    expect(lambda: spmd.make_mesh({"fsd": 2}), "unknown mesh axis")
    mesh = spmd.make_mesh({"tp": 2})
    rules = spmd.Rules.default()
    expect(lambda: spmd.parallelize(Unannotated(), mesh, rules), r"cannot infer .* 'proj.weight' .* spmd.annotate")
    expect(lambda: spmd.parallelize(Clash(), mesh, rules), "mesh axis 'tp' would shard both dim")
    expect(
        lambda: spmd.parallelize(Odd(), mesh, rules),
        r"'proj.weight' with shape \(3, 4\).*size 3 does not divide by tp=2",
    )
    pinned = Odd()
    spmd.annotate(pinned.proj.weight, spmd.P("tp", "tp"))
    expect(lambda: spmd.parallelize(pinned, mesh, rules), "mesh axis 'tp' is used for dims 0 and 1")
    model = spmd.parallelize(tiny_model(), mesh, rules)
    expect(lambda: spmd.parallelize(model, mesh, rules), "already parallelized")

    # ranks that disagree: each rank's call is valid alone; the agreement exchange (one all-gather) is all
    # that runs before every rank raises
    agreement = {"allgather_": 1}
    other_rules = spmd.Rules.default(sequence_parallel=rank == 1)
    _raises_after(
        lambda: spmd.parallelize(tiny_model(), mesh, other_rules),
        r"ranks disagree with rank 0 on rank 1: rules;.*Start every rank with the same",
        agreement,
    )
    other_mesh = spmd.make_mesh({"fsdp": 2} if rank == 0 else {"tp": 2})
    _raises_after(
        lambda: spmd.parallelize(tiny_model(), other_mesh, rules),
        r"rank 1: mesh, parameters; mesh here \(rank \d\): \{'(fsdp|tp)': 2\}",
        agreement,
    )


@pytest.mark.slow
def test_bad_configs_and_disagreeing_ranks_raise_on_every_rank_before_any_collective():
    run_distributed(_every_rank_raises, 2, timeout_s=60)


def test_explain_reports_indivisible_layouts_without_processes():
    with pytest.raises(ValueError, match=r"does not divide by tp=3"):
        spmd.explain(tiny_model(), spmd.Rules.default(), {"tp": 3}, batch_shape=(3, 16))
