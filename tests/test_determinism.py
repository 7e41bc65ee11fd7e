"""Determinism: the same corpus on 1 and 2 worker processes and under three batch budgets gives the same
sentence ids and vectors (to float32 round-off, <= 1e-6), whatever the batches and bundles were."""
import pytest

from elmo_pipeline.pipeline.run import counters, run
from tests.resume_helpers import argv, assert_same_output, read_output, write_corpus

pytestmark = pytest.mark.slow   # servers, worker processes or killed processes

BUDGETS = ("4096", "1024", "256")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_files):
    tmp = tmp_path_factory.mktemp("determinism")
    corpus = write_corpus(str(tmp / "docs.txt"), n_docs=40, seed=11)
    out = {}
    for budget in BUDGETS:
        d = str(tmp / f"w1-{budget}")
        out[(1, budget)] = (counters(run(argv(tiny_model_files, corpus, d, "--max-tokens-per-batch", budget,
                                              "--shard-sentences", "50"))), read_output(d))
    d = str(tmp / "w2-1024")
    out[(2, "1024")] = (counters(run(argv(tiny_model_files, corpus, d, "--max-tokens-per-batch", "1024",
                                          "--direct_num_workers", "2", "--direct_running_mode", "multi_processing",
                                          "--shard-sentences", "50"))), read_output(d))
    return out


def test_batch_budgets_and_worker_processes_give_identical_content(runs):
    (c_ref, ref) = runs[(1, "4096")]
    assert ref[0]["counts"]["sentences"] > 100
    batches = {k: c["batches"] for k, (c, _) in runs.items()}
    assert batches[(1, "256")] > batches[(1, "1024")] > batches[(1, "4096")]    # really different batches
    for key, (_, got) in runs.items():
        if key != (1, "4096"):
            assert_same_output(got, ref, tol=1e-6)
    # the run key does not depend on workers; it does on the budget (it caps long-sentence windows)
    assert runs[(2, "1024")][1][0]["run"]["key"] == runs[(1, "1024")][1][0]["run"]["key"]
