"""Training, resuming, fine-tuning, evaluating and exporting biLMs, on slices of real text (WikiText-2)."""
import itertools
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

from elmo_pipeline.training.data import (BatchMaker, build_vocabulary, encode_corpus, epoch_batches, read_lines,
                           unigram_perplexity)
from elmo_pipeline.training.train import (TrainConfig, batch_maker, build_model, default_options, evaluate, load_exported,
                         read_curves, train)
from elmo_pipeline.model.vocab import Vocabulary
from elmo_pipeline.model.weights import load_bilm
from tests.conftest import REPO, shared_path


def tiny_options(token_encoder="char", **over):
    o = default_options(token_encoder)
    o["lstm"].update(dim=64, projection_dim=32)
    if "char_cnn" in o:
        o["char_cnn"].update(embedding={"dim": 8}, filters=[[1, 16], [2, 16], [3, 32], [4, 32]])
    o.update(batch_size=16, unroll_steps=30, dropout=0.1, softmax={"type": "full"},
             vocab={"max_size": None, "min_count": 2})
    o["optimizer"] = {"name": "adam", "learning_rate": 0.005, "lr_decay": "linear"}
    o.update(over)
    return o


def slice_file(tmp_path, name, src, n_lines):
    """The first n_lines non-blank lines of a WikiText-2 file, written to tmp_path/name."""
    lines = itertools.islice((l for l in open(shared_path("data", "wikitext-2", src), encoding="utf-8") if l.strip()), n_lines)
    path = tmp_path / name
    path.write_text("".join(lines), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    d = tmp_path_factory.mktemp("wt2")
    return {"train": slice_file(d, "train.txt", "train.txt", 600),
            "small": slice_file(d, "small.txt", "train.txt", 150),
            "valid": slice_file(d, "valid.txt", "valid.txt", 150)}


def _cfg(texts, out, **kw):
    kw.setdefault("options", tiny_options())
    return TrainConfig(train_files=[kw.pop("train", texts["train"])], out_dir=str(out), progress=False, threads=1, **kw)


@pytest.fixture(scope="module")
def trained(texts, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    opts = tiny_options(dropout=0.0)
    opts["optimizer"]["learning_rate"] = 0.01
    summary = train(_cfg(texts, out, valid_files=[texts["valid"]], max_steps=400, checkpoint_every=200,
                         log_every=50, options=opts))
    return out, summary


def test_padded_training_forward_equals_bilm(texts):
    """The training forward pass (model/padded_forward.py) gives BiLM.forward's top layer exactly enough."""
    from elmo_pipeline.model.padded_forward import top_layer
    lines = list(read_lines(texts["valid"]))[:40]
    vocab = build_vocabulary(__import__("collections").Counter(t for l in lines for t in l))
    opts = tiny_options(dropout=0.0)
    torch.manual_seed(3)
    head = build_model(opts, vocab).eval()
    corpus = encode_corpus(lines, vocab, 30)
    b = batch_maker(head, corpus)(list(range(12)))
    assert len(set(b.lengths.tolist())) > 3
    with torch.no_grad():
        layers, _ = head.bilm(b.inputs, b.lengths)
        f, bw = top_layer(head.bilm, b.inputs, b.lengths)
    m = torch.arange(b.inputs.shape[1])[None] < b.lengths[:, None]
    P = head.opts.projection_dim
    torch.testing.assert_close(f[m], layers[-1][..., :P][m], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bw[m], layers[-1][..., P:][m], rtol=1e-5, atol=1e-6)


def test_char_columns_cut_is_exact(texts):
    """Cutting character padding columns (BatchMaker) leaves the char CNN's token vectors unchanged."""
    lines = list(read_lines(texts["valid"]))[:30]
    vocab = build_vocabulary(__import__("collections").Counter(t for l in lines for t in l))
    torch.manual_seed(0)
    head = build_model(tiny_options(dropout=0.0), vocab).eval()
    corpus = encode_corpus(lines, vocab, 30)
    full, cut = BatchMaker(corpus, True, 50)(range(8)), batch_maker(head, corpus)(range(8))
    assert cut.inputs.shape[-1] < full.inputs.shape[-1] == 50
    with torch.no_grad():
        a = head.bilm.encode_tokens(full.inputs.reshape(-1, 50))
        b = head.bilm.encode_tokens(cut.inputs.reshape(-1, cut.inputs.shape[-1]))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_epoch_batches_deterministic_and_complete():
    lengths = np.random.default_rng(0).integers(3, 40, size=203)
    a, b = epoch_batches(lengths, 10, 7, 2), epoch_batches(lengths, 10, 7, 2)
    assert all((x == y).all() for x, y in zip(a, b)) and len(a) == 20
    assert len(set(np.concatenate(a).tolist())) == 200
    assert not all((x == y).all() for x, y in zip(a, epoch_batches(lengths, 10, 7, 3)))


def test_training_beats_unigram_and_export_reloads(trained, texts):
    out, summary = trained
    vocab = Vocabulary.load(str(out / "vocab.txt"))
    opts = json.loads((out / "options.json").read_text())
    heldout = encode_corpus(read_lines(texts["valid"]), vocab, opts["unroll_steps"])
    train_c = encode_corpus(read_lines(texts["train"]), vocab, opts["unroll_steps"])
    unigram = unigram_perplexity(train_c, heldout, len(vocab))
    head, _, has_softmax = load_exported(str(out / "model"))
    ppl = evaluate(head, heldout)
    assert has_softmax
    assert ppl.ppl_fwd < 0.7 * unigram and ppl.ppl_bwd < 0.7 * unigram, (ppl.as_dict(), unigram)
    assert abs(ppl.ppl_mean - summary["valid"]["ppl_mean"]) < 1e-3 * ppl.ppl_mean
    # curves: CSV rows and a PNG
    rows = read_curves(str(out / "curves.csv"))
    assert [r["step"] for r in rows if r["split"] == "valid"] == ["200", "400"]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the exported model loads with the plain biLM loader and gives the trained model's vectors
    model = out / "model"
    reloaded = load_bilm(str(model / "options.json"), str(model / "weights.hdf5"))
    b = batch_maker(head, heldout)(range(6))
    with torch.no_grad():
        x, _ = reloaded(b.inputs, b.lengths)
        y, _ = head.bilm(b.inputs, b.lengths)
    assert torch.equal(x, y)
    with h5py.File(model / "weights.hdf5") as f:
        assert "char_embed" in f and "softmax" in f and f["char_embed"].shape[0] == 261


def test_resume_after_interruption_matches_uninterrupted(texts, tmp_path):
    """Stop at step 14 (checkpoints every 7), resume to 24: same per-step losses and weights as one run."""
    kw = dict(train=texts["small"], max_steps=24, checkpoint_every=7, log_every=1, seed=5,
              options=tiny_options(batch_size=8, dropout=0.2))
    train(_cfg(texts, tmp_path / "a", **kw))
    train(_cfg(texts, tmp_path / "b", stop_after_steps=14, **kw))
    assert not (tmp_path / "b" / "model").exists()
    train(_cfg(texts, tmp_path / "b", resume=True, **kw))
    a, b = (read_curves(str(tmp_path / r / "curves.csv")) for r in "ab")
    key = ("step", "loss_fwd", "loss_bwd", "lr")
    assert [[r[k] for k in key] for r in a] == [[r[k] for k in key] for r in b]
    assert len(a) == 24
    with h5py.File(tmp_path / "a" / "model" / "weights.hdf5") as fa, h5py.File(tmp_path / "b" / "model" / "weights.hdf5") as fb:
        names = []
        fa.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        for n in names:
            np.testing.assert_array_equal(fa[n][()], fb[n][()], err_msg=n)


def test_init_from_reuses_weights_and_softmax(trained, texts, tmp_path):
    out, _ = trained
    train(_cfg(texts, tmp_path / "ft", train=texts["small"], init_from=str(out / "model"), max_steps=0))
    with h5py.File(out / "model" / "weights.hdf5") as fa, h5py.File(tmp_path / "ft" / "model" / "weights.hdf5") as fb:
        for n in ("char_embed", "RNN_1/RNN/MultiRNNCell/Cell1/LSTMCell/W_0", "softmax/out.weight"):
            np.testing.assert_array_equal(fa[n][()], fb[n][()], err_msg=n)
    assert (tmp_path / "ft" / "vocab.txt").read_text() == (out / "vocab.txt").read_text()
    # a few fine-tuning steps start from the trained model's loss, far below a fresh model's
    s = train(_cfg(texts, tmp_path / "ft2", train=texts["small"], init_from=str(out / "model"), max_steps=5, log_every=1))
    first = float(read_curves(str(tmp_path / "ft2" / "curves.csv"))[0]["loss_fwd"])
    assert first < 6.5, first


def test_word_encoder_trains_and_embeds(texts, tmp_path):
    from elmo_pipeline.model.embedder import ElmoEmbedder
    opts = tiny_options("word", batch_size=8)
    train(_cfg(texts, tmp_path, train=texts["small"], options=opts, max_steps=10))
    m = tmp_path / "model"
    assert "char_cnn" not in json.loads((m / "options.json").read_text())
    e = ElmoEmbedder(str(m / "options.json"), str(m / "weights.hdf5"), vocab_file=str(m / "vocab.txt"))
    assert e.embed_sentence(["The", "game", "began", "."]).shape == (3, 4, 64)
    more = tmp_path / "more.txt"      # more tokens than the embedding has rows: refused, not IndexErrors per batch
    more.write_text((m / "vocab.txt").read_text() + "".join(f"extra{i}\n" for i in range(5)))
    n = json.loads((m / "options.json").read_text())["n_tokens_vocab"]
    with pytest.raises(ValueError, match=f"more than the model's n_tokens_vocab {n} tokens"):
        ElmoEmbedder(str(m / "options.json"), str(m / "weights.hdf5"), vocab_file=str(more))


def test_evaluate_and_export_commands(trained, texts, tmp_path):
    from elmo_pipeline.pipeline.cli import main
    out, _ = trained
    res = tmp_path / "ppl.json"
    assert main(["evaluate", texts["valid"], "--model", str(out / "model"), "--json", str(res),
                 "--unigram-baseline", texts["train"]]) == 0
    r1 = json.loads(res.read_text())
    assert r1["ppl_mean"] < r1["unigram_ppl"]
    ckpt = sorted((out / "checkpoints").glob("ckpt-*.h5"))[-1]
    assert main(["export", str(out), str(tmp_path / "exp")]) == 0
    assert main(["evaluate", texts["valid"], "--checkpoint", str(ckpt), "--json", str(res)]) == 0
    assert abs(json.loads(res.read_text())["ppl_mean"] - r1["ppl_mean"]) < 1e-6 * r1["ppl_mean"]
    with h5py.File(tmp_path / "exp" / "weights.hdf5") as fa, h5py.File(out / "model" / "weights.hdf5") as fb:
        np.testing.assert_array_equal(fa["CNN/W_cnn_0"][()], fb["CNN/W_cnn_0"][()])


def test_checkpoint_is_arrays_and_json_only(trained):
    out, _ = trained
    ckpt = sorted((out / "checkpoints").glob("ckpt-*.h5"))[-1]
    with h5py.File(ckpt) as f:
        kinds = set()
        f.visititems(lambda n, o: kinds.add(o.dtype.kind) if isinstance(o, h5py.Dataset) else None)
        meta = json.loads(f.attrs["meta"])
    assert kinds <= {"f", "u", "i"} and meta["step"] == 400


@pytest.mark.slow
def test_torchrun_two_processes_equal_one(texts, tmp_path):
    """2 gloo processes (half the batch each, gradients summed, loss over the global token count) give
    the weights of 1 process. Adagrad (bilm-tf's optimizer) keeps float-rounding differences of tiny
    gradients tiny, where Adam's normalisation could blow them up to lr-sized steps."""
    opts = tiny_options(batch_size=8, dropout=0.0, optimizer={"name": "adagrad", "learning_rate": 0.2})
    (tmp_path / "opts.json").write_text(json.dumps(opts))
    common = [texts["small"], "--options", str(tmp_path / "opts.json"), "--max-steps", "12", "--threads", "1",
              "--no-progress", "--seed", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    one = subprocess.run([sys.executable, "-m", "elmo_pipeline.pipeline.train_command", *common, "--output", str(tmp_path / "one")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          "-m", "elmo_pipeline.pipeline.train_command", *common, "--output", str(tmp_path / "two")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    with h5py.File(tmp_path / "one" / "model" / "weights.hdf5") as fa, h5py.File(tmp_path / "two" / "model" / "weights.hdf5") as fb:
        names = []
        fa.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert len(names) > 10
        for n in names:
            np.testing.assert_allclose(fb[n][()], fa[n][()], rtol=1e-4, atol=1e-5, err_msg=n)
    a, b = (read_curves(str(tmp_path / r / "curves.csv")) for r in ("one", "two"))
    assert [r["step"] for r in a] == [r["step"] for r in b]


def test_raw_tokenizer_gives_sentences():
    from elmo_pipeline.training.data import get_tokenizer
    try:
        tok = get_tokenizer("raw")
        sents = tok("The cat sat. It was well-known!")
    except (RuntimeError, ImportError) as e:
        pytest.skip(f"the raw tokenizer (tokenization/tokenizers.py) is unavailable here: {e}")
    assert len(sents) == 2 and sents[0][:2] == ["The", "cat"]
    assert get_tokenizer("whitespace")("  a b  ") == [["a", "b"]] and get_tokenizer("whitespace")("  ") == []


def test_shipped_default_model():
    """The shipped model loads with no arguments, and its perplexity on the start of WikiText-2 test is
    in line with its model card (a 100-paragraph slice, so only loosely)."""
    import re
    from elmo_pipeline.model.embedder import ElmoEmbedder
    from elmo_pipeline.model.pretrained import HERE, DEFAULT_MODEL
    folder = os.path.join(HERE, DEFAULT_MODEL)
    if not os.path.isfile(os.path.join(folder, "weights.hdf5")):
        pytest.skip(f"the shipped model is not in this checkout ({folder})")
    e = ElmoEmbedder()
    assert e.embed_sentence(["The", "game", "began", "development", "in", "2010", "."]).shape == (3, 7, e.output_dim)
    card = open(os.path.join(folder, "MODEL_CARD.md"), encoding="utf-8").read()
    stated = float(re.search(r"test perplexity.*?mean\D*([0-9.]+)", card, re.I | re.S).group(1))
    assert "elmo-pipeline train" in card and "CC BY-SA 3.0" in card
    head, vocab, has_softmax = load_exported(folder)
    test = shared_path("data", "wikitext-2", "test.txt")
    lines = list(itertools.islice(read_lines(test), 100))
    opts = json.load(open(os.path.join(folder, "options.json")))
    ppl = evaluate(head, encode_corpus(lines, vocab, opts["unroll_steps"]))
    assert ppl.ppl_mean < 1.5 * stated, (ppl.as_dict(), stated)


def test_read_lines_globs_urls_and_gzip(tmp_path):
    import gzip
    from elmo_pipeline.training.data import read_lines
    (tmp_path / "a.txt").write_text("one two\n\n three \n", encoding="utf-8")
    with gzip.open(tmp_path / "b.txt.gz", "wt", encoding="utf-8") as f:
        f.write("four five six\n")
    assert list(read_lines(str(tmp_path / "*.txt*"))) == [["one", "two"], ["three"], ["four", "five", "six"]]
    assert list(read_lines(f"file://{tmp_path}/a.txt")) == [["one", "two"], ["three"]]
    with pytest.raises(FileNotFoundError):
        list(read_lines(str(tmp_path / "nothing-*.txt")))


def test_a_run_resumes_only_on_its_own_text_vocabulary_and_arrays_and_keeps_its_schedule(texts, tmp_path):
    """A run stopped at step 2 of 6: --resume without --max-steps finishes the 6 steps its checkpoint records
    (before: a schedule recomputed from the options); resuming on other text, with its vocab.txt reordered at its
    size, or from a checkpoint whose arrays changed at their size is refused naming the cause (before: exit 0,
    trained on; evaluate and export read the damaged checkpoint)."""
    import shutil
    from elmo_pipeline.training.train import head_from_checkpoint, latest_checkpoint
    run = tmp_path / "run"
    train(_cfg(texts, run, train=texts["small"], max_steps=6, stop_after_steps=2, checkpoint_every=2, log_every=1))
    assert latest_checkpoint(str(run)).endswith("ckpt-00000002.h5")
    for name, change in (("text", None), ("vocab", "vocab.txt"), ("arrays", "checkpoint")):
        copy = tmp_path / name
        shutil.copytree(run, copy)
        ckpt = latest_checkpoint(str(copy))
        if change == "vocab.txt":
            lines = (copy / "vocab.txt").read_bytes().splitlines(keepends=True)
            (copy / "vocab.txt").write_bytes(b"".join(lines[:3] + lines[3:][::-1]))
            match = "not the vocabulary"
        elif change == "checkpoint":
            with h5py.File(ckpt, "a") as f:
                name0 = sorted(f["model"])[0]
                while isinstance(f["model"][name0], h5py.Group):
                    name0 = f"{name0}/{sorted(f['model'][name0])[0]}"
                f["model"][name0][...] = f["model"][name0][...] + 1.0
            match = "model arrays are not the ones it recorded"
        else:
            match = "the training text is not the one"
        kw = dict(train=texts["train"]) if name == "text" else dict(train=texts["small"])
        with pytest.raises(ValueError, match=match):
            train(_cfg(texts, copy, resume=True, checkpoint_every=2, log_every=1, **kw))
        if change:
            with pytest.raises(ValueError, match=match):
                head_from_checkpoint(ckpt)
    summary = train(_cfg(texts, run, train=texts["small"], resume=True, checkpoint_every=2, log_every=1))
    assert latest_checkpoint(str(run)).endswith("ckpt-00000006.h5"), summary


# A short run of the tiny options that checkpoints at steps 2 and 4, on one thread, quietly, not exported.
RESUMABLE = ("--max-steps", "4", "--checkpoint-every", "2", "--threads", "1", "--no-progress", "--no-export")


def _train_command(*argv):
    """The `train` subcommand's run() on this command line, parsed by its own arguments."""
    import argparse
    from elmo_pipeline.pipeline.train_command import add_arguments, run
    p = argparse.ArgumentParser()
    add_arguments(p)
    return run(p.parse_args(list(argv)))


def test_a_resume_whose_flags_differ_from_the_run_is_refused_not_ignored(texts, tmp_path):
    """`train --resume` keeps the run's options, seed and tokenizer: a flag given with another value (--lr, --seed,
    --tokenizer, --batch-size) was ignored without a word (trained on at the recorded values, exit 0); now one error
    naming the flag and the recorded value. The run's own command line again resumes it; flags it did not give pass."""
    from elmo_pipeline.training.train import latest_checkpoint
    (tmp_path / "opts.json").write_text(json.dumps(tiny_options()))

    def train_with(*flags):
        return _train_command(texts["small"], "--output", str(tmp_path / "run"), "--options",
                              str(tmp_path / "opts.json"), *RESUMABLE, *flags)
    train_with("--lr", "0.004", "--seed", "3", "--stop-after", "2")
    for flag, value, recorded in (("--lr", "0.01", "0.004"), ("--seed", "4", "3"), ("--tokenizer", "raw", "whitespace"),
                                  ("--batch-size", "8", "16"), ("--token-encoder", "word", "char")):
        with pytest.raises(ValueError, match=f"--resume: {flag} {value} but the run in .* was trained with {recorded}:"):
            train_with("--resume", flag, value)
    assert latest_checkpoint(str(tmp_path / "run")).endswith("ckpt-00000002.h5")
    train_with("--resume", "--lr", "0.004", "--n-layers", "2", "--token-encoder", "char")   # the recorded values
    assert latest_checkpoint(str(tmp_path / "run")).endswith("ckpt-00000004.h5")


def test_init_from_with_a_flag_for_the_lstm_shape_is_refused_not_ignored(trained, texts, tmp_path):
    """`train --init-from MODEL --lstm-dim 128`: the model's shape was taken, the flag dropped without a word; now one
    error naming the flag, before anything is written."""
    out, _ = trained
    with pytest.raises(ValueError, match=r"--init-from .*: its model gives the LSTM's shape; --lstm-dim cannot"):
        _train_command(texts["small"], "--output", str(tmp_path / "ft"), "--init-from", str(out / "model"),
                       "--lstm-dim", "128", *RESUMABLE)
    assert not (tmp_path / "ft").exists()


def test_a_resume_whose_options_file_differs_from_the_run_is_refused_not_ignored(texts, tmp_path):
    """`train --resume --options F`: the resumed run keeps the options its checkpoint records, so an options file
    changed since (a learning rate, a batch size) was ignored without a word, as a changed flag was; now one error
    naming the file, the key and the recorded value. The run's own file again resumes it (its n_tokens_vocab, which
    the vocabulary sets, is not compared)."""
    from elmo_pipeline.training.train import latest_checkpoint
    opts = {**tiny_options(), "n_tokens_vocab": 7}
    (tmp_path / "opts.json").write_text(json.dumps(opts))

    def train_with(*flags):
        return _train_command(texts["small"], "--output", str(tmp_path / "run"), "--options",
                              str(tmp_path / "opts.json"), *RESUMABLE, *flags)
    train_with("--stop-after", "2")
    (tmp_path / "opts.json").write_text(json.dumps({**opts, "batch_size": opts.get("batch_size", 32) + 1}))
    with pytest.raises(ValueError, match=r"^--resume: --options \S+opts.json \('batch_size'\) \d+ but the run in .* "
                                         r"was trained with \d+:"):
        train_with("--resume")
    assert latest_checkpoint(str(tmp_path / "run")).endswith("ckpt-00000002.h5")
    (tmp_path / "opts.json").write_text(json.dumps(opts))
    train_with("--resume")
    assert latest_checkpoint(str(tmp_path / "run")).endswith("ckpt-00000004.h5")
