"""Short training scripts exit 0 on every rank (benchmarks.clean_exits): 6 torchrun launches of 4 processes,
3 at a time, of a user script that lays a tiny Llama out on tp=4 (and tp=4,sp), trains 3 AdamW steps and
ends with `destroy_process_group()` twice (each guarded by `is_initialized()`), one of them with an
`AsyncSaver` checkpoint started after the last step and never waited for. Each launch must exit 0 with every
rank's loss written and, for the checkpoint, `latest` committed. The many-launch count is the benchmark's
(`python -m benchmarks.clean_exits --launches 30`).

Mutation that fails it: AsyncSaver no longer making `destroy_process_group` and the interpreter's exit wait
for the save in flight (`_finish_saves_before_exit` returning at once): the writer, still in a gloo collective
as the interpreter finalizes, aborts its rank ("terminate called without an active exception", SIGABRT) and
the checkpoint is never committed, in every launch.
"""
import pytest

from benchmarks import clean_exits


@pytest.mark.slow
def test_short_tp_scripts_exit_zero_under_load():
    rows = clean_exits.run(["bare", "async", "sp"], launches=2, parallel=3, timeout_s=400)
    failed = [{k: r[k] for k in ("case", "rc", "ranks_wrote", "committed", "aborted")} for r in rows if not r["ok"]]
    assert not failed, f"{len(failed)} of {len(rows)} launches did not exit cleanly: {failed}\n" + \
        "\n".join(r["output_tail"][-1500:] for r in rows if not r["ok"])
