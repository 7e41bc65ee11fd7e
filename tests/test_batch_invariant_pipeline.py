"""--batch-invariant (a switch, with --state stateless/warm) through the pipeline: the same sentences' vectors are the
same bytes under token budgets 256, 1,024, 4,096 and 16,384, with one and with two worker processes, and after a
SIGKILL and a resume; one-shard runs under two budgets give Parquet and HDF5 files with equal SHA-256. The
manifest records the setting and the run key follows it. Model-level checks: tests/test_batch_invariant.py."""
import hashlib
import os

import pytest

from elmo_pipeline.pipeline.run import main
from tests.resume_helpers import argv, assert_same_output, read_output, run_subprocess, write_corpus

BUDGETS = ("256", "1024", "4096", "16384")
ONE_SHARD = ("--shard-sentences", "100000")
INV = "--batch-invariant"


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("corpus") / "docs.txt"), n_docs=30, seed=5)


@pytest.fixture(scope="module")
def budget_runs(corpus, tiny_model_files, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("budgets")
    out = {}
    for budget in BUDGETS:
        d = str(tmp / budget)
        assert main(argv(tiny_model_files, corpus, d, "--max-tokens-per-batch", budget, *ONE_SHARD, INV)) == 0
        out[budget] = (d, read_output(d))
    return out


def test_budgets_give_the_same_bytes(budget_runs):
    ref_dir, ref = budget_runs["16384"]
    assert ref[0]["counts"]["sentences"] > 60 and len(ref[0]["shards"]) == 1
    for budget, (d, got) in budget_runs.items():
        assert_same_output(got, ref, tol=0.0)              # every vector, exactly
        for fmt in ("parquet", "hdf5"):                    # the whole files: equal SHA-256
            assert [sha256(os.path.join(d, s[fmt])) for s in got[0]["shards"]] == \
                [sha256(os.path.join(ref_dir, s[fmt])) for s in ref[0]["shards"]], (budget, fmt)


def test_manifest_records_it_and_the_run_key_follows_it(budget_runs, corpus, tiny_model_files, tmp_path):
    m = budget_runs["1024"][1][0]
    assert m["options"]["batch_invariant"] is True and m["model"]["batch_invariant"] is True
    d = str(tmp_path / "fast")
    assert main(argv(tiny_model_files, corpus, d, "--max-tokens-per-batch", "1024", *ONE_SHARD)) == 0   # default
    fast = read_output(d)
    assert fast[0]["options"]["batch_invariant"] is False and fast[0]["model"]["batch_invariant"] is False
    assert fast[0]["run"]["key"] != m["run"]["key"]          # outputs of the two paths never mix in a resume
    assert_same_output(fast, budget_runs["1024"][1], tol=1e-5)


def test_stateful_refuses_batch_invariant(corpus, tiny_model_files, tmp_path, capsys):
    assert main(argv(tiny_model_files, corpus, str(tmp_path / "o"), "--state", "stateful", "--batch-invariant")) == 2
    assert "--batch-invariant needs --state stateless or warm" in capsys.readouterr().err


@pytest.mark.slow
def test_two_worker_processes_give_the_same_bytes(budget_runs, corpus, tiny_model_files, tmp_path):
    d = str(tmp_path / "w2")
    assert main(argv(tiny_model_files, corpus, d, "--max-tokens-per-batch", "1024", *ONE_SHARD, INV,
                     "--direct_num_workers", "2", "--direct_running_mode", "multi_processing")) == 0
    ref = budget_runs["1024"][1]
    got = read_output(d)
    assert_same_output(got, ref, tol=0.0)
    assert got[0]["run"]["key"] == ref[0]["run"]["key"]
    # each worker writes its own shards, so they hold other sets of sentences than the one-worker shard: the
    # files cannot be compared whole, the vectors were (above), bit for bit
    assert len(got[0]["shards"]) >= len(ref[0]["shards"])


@pytest.mark.slow
def test_sigkill_and_resume_give_the_same_bytes(corpus, tiny_model_files, tmp_path):
    """Killed while embedding the 3rd batch, then rerun: the resumed run embeds the rest in other batches, yet
    every vector equals the uninterrupted run's, bit for bit."""
    small = ("--shard-sentences", "4", "--max-tokens-per-batch", "256", INV)
    ref_dir = str(tmp_path / "ref")
    assert main(argv(tiny_model_files, corpus, ref_dir, *small)) == 0
    ref = read_output(ref_dir)
    out = str(tmp_path / "out")
    args = argv(tiny_model_files, corpus, out, *small)
    p = run_subprocess(args, "embed:3")
    assert p.returncode == -9, p.stderr[-2000:]
    assert main(args) == 0
    got = read_output(out)
    assert 0 < got[0]["run"]["resumed_sentences"] < got[0]["counts"]["sentences"]
    assert_same_output(got, ref, tol=0.0)


def test_elmo_command_batch_sizes_give_the_same_bytes(tiny_model_files, tmp_path):
    """`elmo --batch-invariant`: --batch-size 1 and a 256-slot budget write the same vector bytes."""
    import h5py

    from elmo_pipeline.pipeline.cli import main as cli
    from tests.test_batch_invariant import sentences
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(" ".join(s) for s in sentences(30, max_len=25)) + "\n")
    options, weights = tiny_model_files
    files = {}
    for name, extra in {"b1": ["--batch-size", "1"], "budget": ["--max-tokens-per-batch", "256"]}.items():
        files[name] = tmp_path / f"{name}.hdf5"
        assert cli(["elmo", str(inp), str(files[name]), "--all", "--batch-invariant", "--options-file", options,
                    "--weight-file", weights, *extra]) == 0
    with h5py.File(files["b1"]) as a, h5py.File(files["budget"]) as b:
        keys = [k for k in a if k != "sentence_to_index"]
        assert len(keys) == 30 and sorted(keys) == sorted(k for k in b if k != "sentence_to_index")
        assert all(a[k][...].tobytes() == b[k][...].tobytes() for k in keys)
