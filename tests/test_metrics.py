"""<out>/metrics.prom and --metrics-file: read back with prometheus_client's parser (the Prometheus text format
node_exporter's textfile collector reads), the counts equal manifest.json's; the collector file is written by
rename and adds the exit status."""
import json
import os

import pytest

from elmo_pipeline.pipeline.run import main
from tests.resume_helpers import argv
from tests.test_dask import dirty_corpus

parser = pytest.importorskip("prometheus_client.parser")


def families(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return {fam.name: fam for fam in parser.text_string_to_metric_families(f.read())}


def value(fams, name, **labels):
    (s,) = [s for s in fams[name].samples if s.name == name or s.name == name + "_total"
            if all(s.labels.get(k) == v for k, v in labels.items())]
    return s.value


@pytest.fixture(scope="module")
def run(tiny_model_files, tmp_path_factory):
    d = tmp_path_factory.mktemp("metrics")
    files = dirty_corpus(d / "corpus")
    out, collector = str(d / "out"), d / "collector"
    collector.mkdir()
    args = argv(tiny_model_files, files, out, "--shard-sentences", "7", "--metrics-file",
                str(collector / "elmo.prom"))
    assert main(args) == 0
    return out, collector, json.load(open(os.path.join(out, "manifest.json")))


def test_metrics_file_equals_the_manifests_counts(run):
    out, _, m = run
    fams = families(os.path.join(out, "metrics.prom"))
    assert m["metrics"] == "metrics.prom"
    counts = m["counts"]
    for key in ("input_records", "blank_records", "record_dead_letters", "documents", "sentences",
                "sentences_written", "tokens_written", "dead_letters", "dead_letter_sentences"):
        # prometheus_client names a counter family without its _total
        assert value(fams, f"elmo_pipeline_{key}", output=out) == counts[key], key
    assert counts["dead_letters_by_reason"]               # the dirty corpus has some
    for reason, n in counts["dead_letters_by_reason"].items():
        assert value(fams, "elmo_pipeline_dead_letters_by_reason", output=out, reason=reason) == n
    assert value(fams, "elmo_pipeline_shards", output=out) == len(m["shards"]) >= 2
    assert value(fams, "elmo_pipeline_resumed_sentences", output=out) == m["run"]["resumed_sentences"]
    stages = {s.labels["stage"]: s.value for s in fams["elmo_pipeline_stage_seconds"].samples}
    assert set(stages) == {"read", "tokenize", "batch", "embed", "write"} and stages["embed"] > 0
    assert fams["elmo_pipeline_run_info"].samples[0].labels["run_key"] == m["run"]["key"]
    assert fams["elmo_pipeline_sentences_written"].type == "counter"


def test_the_collector_file_adds_the_exit_status_and_is_renamed_into_place(run):
    out, collector, m = run
    assert os.listdir(collector) == ["elmo.prom"]
    fams = families(collector / "elmo.prom")
    assert value(fams, "elmo_pipeline_exit_status", output=out) == 0
    assert value(fams, "elmo_pipeline_tokens_written", output=out) == m["counts"]["tokens_written"]


def test_an_already_complete_rerun_rewrites_the_collector_file_with_the_same_counts(run, tiny_model_files):
    out, collector, m = run
    before = os.path.getmtime(os.path.join(out, "metrics.prom"))
    target = collector / "again.prom"
    args = argv(tiny_model_files, run_input(out), out, "--shard-sentences", "7", "--metrics-file", str(target))
    assert main(args) == 0
    assert os.path.getmtime(os.path.join(out, "metrics.prom")) == before       # the output is left as it is
    fams = families(target)
    assert value(fams, "elmo_pipeline_sentences", output=out) == m["counts"]["sentences"]
    assert value(fams, "elmo_pipeline_exit_status", output=out) == 0


@pytest.mark.parametrize("change", ["swapped", "grown", "fifo"])
def test_the_collector_file_takes_the_outputs_metrics_only_as_recorded(change, run, tiny_model_files, tmp_path, capsys):
    """The output's metrics.prom read back for --metrics-file is the file the run's manifest records: one changed at
    its size (another run's counts, written over it between this run's end and the read), one grown to 32 MiB, or a
    FIFO (never opened: no hang) gives a collector file with the exit status and without the counts, and a warning
    line, never their contents."""
    import shutil
    import threading
    import time
    src, _, m = run
    out = str(tmp_path / "out")
    shutil.copytree(src, out)
    prom = os.path.join(out, "metrics.prom")
    text = open(prom).read()
    os.remove(prom)
    if change == "swapped":
        n = str(m["counts"]["sentences"])
        fake = text.replace(f'elmo_pipeline_sentences_total{{output="{src}"}} {n}', "X")
        open(prom, "w").write(fake.replace("X", f'elmo_pipeline_sentences_total{{output="{out}"}} 9{n[1:]}'))
    elif change == "grown":
        with open(prom, "w") as f:
            f.write(text)
            f.truncate(32 << 20)
    else:
        os.mkfifo(prom)

        def unblock():          # the code before this test opened the FIFO and waited for a writer
            time.sleep(15)
            with open(prom, "w"):
                pass
        threading.Thread(target=unblock, daemon=True).start()
    target = tmp_path / "collector.prom"
    t0 = time.time()
    assert main(argv(tiny_model_files, run_input(src), out, "--shard-sentences", "7",
                     "--metrics-file", str(target))) == 0
    assert time.time() - t0 < 12
    assert "already complete" in capsys.readouterr().err
    fams = families(target)
    assert value(fams, "elmo_pipeline_exit_status", output=out) == 0
    assert "elmo_pipeline_sentences" not in fams and os.path.getsize(target) < 4096


@pytest.mark.parametrize("name", ["manifest.json", "metrics.prom", "extra.prom"])
def test_a_metrics_file_inside_the_output_is_refused_before_any_work(name, tiny_model_files, tmp_path, capsys):
    """--metrics-file inside --output (a finished output's manifest.json or metrics.prom, or a file its manifest
    would not record): exit 2, one line, before any work; nothing written there, on the failure path either."""
    out = tmp_path / "out"
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("A line here.\n")
    args = argv(tiny_model_files, str(tmp_path / "corpus" / "*.txt"), str(out), "--metrics-file", str(out / name))
    assert main(args) == 2
    assert "--metrics-file" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not out.exists()


def run_input(out) -> str:
    return os.path.join(os.path.dirname(out), "corpus", "*.txt")


def test_label_values_are_escaped():
    from elmo_pipeline.formats.metrics import render
    text = render([("x_total", "counter", "h", [({"output": 'a"b\\c\nd'}, 3)])])
    (fam,) = parser.text_string_to_metric_families(text)
    assert fam.samples[0].labels["output"] == 'a"b\\c\nd' and fam.samples[0].value == 3


@pytest.mark.parametrize("swap", ["forged", "fifo"])
def test_a_changed_metrics_prom_is_not_copied_into_the_collector_file(swap, run, tiny_model_files, tmp_path, capsys):
    """An already complete rerun copies the output's metrics.prom into --metrics-file only as the file its manifest
    records: one changed since (forged counts, or a FIFO, which would block the read) is left out with a warning
    line; the exit status is still written, and the run's status stays 0."""
    import shutil
    out, _, m = run
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    metrics = copy / "metrics.prom"
    metrics.unlink()
    if swap == "fifo":
        os.mkfifo(metrics)
    else:
        metrics.write_text(f'elmo_pipeline_sentences_total{{output="{copy}"}} 999999\n')
    target = tmp_path / "collector.prom"
    args = argv(tiny_model_files, run_input(out), str(copy), "--shard-sentences", "7", "--metrics-file", str(target))
    assert main(args) == 0
    assert "the output's metrics are left out" in capsys.readouterr().err
    text = target.read_text()
    assert "999999" not in text and "elmo_pipeline_sentences_total" not in text
    assert value(families(target), "elmo_pipeline_exit_status", output=str(copy)) == 0


@pytest.mark.parametrize("url", ["s3://bucket/collector/elmo.prom", "https://host/elmo.prom"])
def test_a_metrics_file_url_is_refused_before_any_work(url, tiny_model_files, tmp_path, capsys):
    """--metrics-file is a local file: a URL was written after the whole run without the run's storage options (to
    another store than the run's, with whatever credentials the environment held, or nowhere: a warning, exit 0).
    Now exit 2, one line naming it, before any work."""
    out = tmp_path / "out"
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("A line here.\n")
    args = argv(tiny_model_files, str(tmp_path / "corpus" / "*.txt"), str(out), "--metrics-file", url)
    assert main(args) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: --metrics-file") and "not a URL" in last
    assert not out.exists()


def test_the_summary_and_its_lines_stay_one_line_each(tiny_model_files, tmp_path, capsys):
    """A folder name holding a newline and a terminal escape (--output, --metrics-file): the summary, the
    --metrics-file warning and an error line are one line each, the characters written escaped (the summary of a
    run that finished printed a second line `error: fake`, and raw escapes)."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("A line here.\n")
    out = str(tmp_path / "out\nerror: fake\x1b[31m")
    collector = str(tmp_path / "gone\nerror: fake\x1b[31m" / "elmo.prom")
    assert main(argv(tiny_model_files, run_input(str(tmp_path / "out")), out, "--metrics-file", collector)) == 0
    lines = capsys.readouterr().err.splitlines()
    assert [line[:22] for line in lines] == ["warning: --metrics-fil", "elmo-pipeline: 1 docum"], lines
    assert "\x1b" not in "".join(lines) and lines[-1].endswith("-> " + out.replace("\n", "\\n").replace("\x1b", "\\x1b"))
    assert main(argv(tiny_model_files, run_input(str(tmp_path / "out")), out, "--metrics-file",
                     os.path.join(out, "m.prom"))) == 2
    lines = capsys.readouterr().err.splitlines()
    assert [line[:22] for line in lines] == ["warning: --metrics-fil", "error: --metrics-file "], lines
    assert "\x1b" not in "".join(lines) and "\\x1b[31m" in lines[-1]


@pytest.mark.parametrize("case", ["another exporter's", "the input", "no --output"])
def test_a_metrics_file_over_a_file_it_did_not_write_is_refused(case, tiny_model_files, tmp_path, capsys):
    """--metrics-file naming a file this command did not write (another exporter's .prom in the collector's
    folder, the run's own input; a command line without --output too): exit 2 before any work, the file as it was
    (it was replaced by Prometheus text, exit 0 or 2)."""
    (tmp_path / "corpus").mkdir()
    corpus = tmp_path / "corpus" / "a.txt"
    corpus.write_text("A line here.\n")
    target = corpus if case != "another exporter's" else tmp_path / "node.prom"
    target.write_text(target.read_text() if target.exists() else "# HELP node_x x\n# TYPE node_x gauge\nnode_x 1\n")
    before = target.read_bytes()
    out = tmp_path / "out"
    args = argv(tiny_model_files, str(corpus), str(out), "--metrics-file", str(target))
    if case == "no --output":
        args = [a for a in args if a != str(out) and a != "--output"]
    assert main(args) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: ")
    assert target.read_bytes() == before and not out.exists()


def test_an_empty_metrics_file_is_written(tiny_model_files, tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("A line here.\n")
    collector = tmp_path / "elmo.prom"
    collector.write_bytes(b"")
    assert main(argv(tiny_model_files, str(tmp_path / "corpus" / "a.txt"), str(tmp_path / "out"), "--metrics-file",
                     str(collector))) == 0
    assert value(families(collector), "elmo_pipeline_exit_status", output=str(tmp_path / "out")) == 0


def test_an_output_named_in_bytes_that_are_not_utf8_is_refused_and_the_metrics_file_written(tiny_model_files,
                                                                                             tmp_path, capsys):
    """--output whose name is not UTF-8 (a byte 0xFF, held by Python as a lone surrogate): exit 2 before any work,
    --metrics-file written with it (the run failed after all its work, exit 70 at EmbedShards, and the collector
    file was not written at all: a warning that the label could not be encoded)."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("A line here.\n")
    out = os.path.join(str(tmp_path), os.fsdecode(b"out\xff"))
    collector = tmp_path / "elmo.prom"
    assert main(argv(tiny_model_files, run_input(str(tmp_path / "out")), out, "--metrics-file", str(collector))) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: --output ")
    assert not os.path.lexists(out)
    (sample,) = families(collector)["elmo_pipeline_exit_status"].samples
    assert sample.value == 2 and sample.labels["output"].endswith("out?")
