"""One identity for an input: distinct inputs get distinct file labels, hence distinct document ids, in every
label mode (default, --id-root, full paths), whatever their names hold (a query, control characters, bytes that
are not UTF-8, text that redaction masks); one file however spelled gets one label."""
import json
import os
import re
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elmo_pipeline.formats.hdf5 import hdf5_unkey
from elmo_pipeline.fsio import expand, redact
from elmo_pipeline.fsio.fs import normalise
from elmo_pipeline.pipeline.run import main
from elmo_pipeline.transforms.ids import escape_label, file_labels
from tests.model_server import ModelServer
from tests.pipeline_helpers import hdf5_arrays, parquet_rows

# characters that have made two names' labels coincide: escapes, controls, redacted credentials, a query
NAME_CHARS = st.sampled_from(["a", "b", "x", ".", "-", "\\", "%", "2", "5", ":", "@", "=", "&", "~", "*", " ",
                              "\x00", "\x01", "\t", "\x7f", "\x85", "\x9f", "\udcff", "\udc85", "\ud800", "é"])
NAMES = st.text(NAME_CHARS, min_size=1, max_size=6).filter(lambda n: n not in (".", ".."))
QUERIES = st.lists(st.tuples(st.sampled_from(["file", "sig", "token", "X-Amz-Signature", "versionId"]),
                             st.sampled_from(["a", "b", "s3cr3t", "***", ""])), max_size=2).map(
    lambda kv: "?" + "&".join(f"{k}={v}" for k, v in kv) if kv else "")
REMOTE = st.tuples(st.sampled_from(["s3://", "https://", "https://u:pw@", "https://v:pw@"]),
                   st.sampled_from(["b/", "c/"]), st.lists(NAMES.filter(lambda n: not set(n) & set("?#")),
                                                           min_size=1, max_size=2), QUERIES).map(
    lambda t: normalise(t[0] + t[1] + "/".join(t[2]) + t[3]))
UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")     # controls, lone surrogates
CREDENTIAL = re.compile("(sig|token|Signature)=s3cr3t")
LOCAL = st.lists(NAMES, min_size=1, max_size=2).map(lambda parts: "/d/" + "/".join(parts))


def distinct_inputs(urls: list[str]) -> list[str]:
    """The inputs as fsio.expand gives them: normalised, a file:// URL as its path, each once."""
    return sorted({u[len("file://"):] if u.startswith("file://") else u for u in map(normalise, urls)})


def assert_distinct(labels: dict[str, str]) -> None:
    assert len(set(labels.values())) == len(labels), labels
    for label in labels.values():
        assert not UNPRINTABLE.search(label) and not CREDENTIAL.search(label) and "pw" not in label, label


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(LOCAL, REMOTE), min_size=1, max_size=5))
def test_distinct_inputs_get_distinct_labels_in_every_mode(urls):
    files = distinct_inputs(urls)
    assert_distinct(file_labels(files))
    assert_distinct(file_labels(files, full=True))
    local = [f for f in files if "://" not in f]
    if local:
        assert_distinct(file_labels(local, "/d"))
    for root in ("s3://b", "https://b"):
        under = [f for f in files if f.startswith(root + "/") or f.startswith(root.replace("//", "//u:pw@") + "/")
                 or f.startswith(root.replace("//", "//v:pw@") + "/")]
        if under:
            assert_distinct(file_labels(under, root))


@settings(max_examples=200, deadline=None)
@given(st.lists(NAMES, min_size=1, max_size=4, unique=True))
def test_labels_escape_reversibly(names):
    """escape_label keeps distinct texts distinct and writes printable UTF-8; printable text without a
    backslash is left as it is."""
    escaped = [escape_label(n) for n in names]
    assert len(set(escaped)) == len(names)
    for name, e in zip(names, escaped):
        assert not UNPRINTABLE.search(e), e
        if name.isprintable() and "\\" not in name:
            assert e == name


SAFE_CHARS = st.sampled_from(["a", "b", "\\", "%", ":", "@", "=", "&", "~", " ", "\x01", "\t", "\x7f", "\udcff",
                              "\udc85", "é", "?"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.text(SAFE_CHARS, min_size=1, max_size=5).filter(lambda n: "::" not in n), min_size=1,
                max_size=4, unique=True))      # "::" chains fsspec URLs
def test_one_file_however_spelled_gets_one_label(names):
    """Real files: every spelling of a file (relative, ./, //, /abs, file:///abs) expands to the one file, and
    its label is the one it gets when named plainly."""
    with tempfile.TemporaryDirectory() as tmp:
        os.mkdir(os.path.join(tmp, "dir"))
        paths = []
        for name in names:
            path = os.path.join(tmp, "dir", name)
            with open(os.fsencode(path), "wb") as f:
                f.write(b"x\n")
            paths.append(path)
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            spelled = [s for name, path in zip(names, paths) if "?" not in name
                       for s in (f"dir/{name}", f"./dir/{name}", f"dir//{name}", path, f"file://{path}")]
            spelled += [f"{tmp}//dir/{name}" for name in names]     # a '?' in a local name: no query
            files = expand(spelled)
        finally:
            os.chdir(cwd)
        assert files == sorted(paths)
        labels = file_labels(files)
        assert_distinct(labels)
        both = file_labels(paths + [f"file://{p}" for p in paths])      # spellings side by side: one label
        assert both == {**labels, **{f"file://{p}": labels[p] for p in paths}}
        assert sorted(labels.values()) == sorted(escape_label(n) for n in names)


def test_inputs_that_differ_only_by_query_get_distinct_labels():
    presigned = ["https://h/c/in.txt?file=a", "https://h/c/in.txt?file=b", "https://h/c/in.txt?token=a",
                 "https://h/c/in.txt?token=b"]
    for labels in (file_labels(presigned), file_labels(presigned, "https://h/c"), file_labels(presigned, full=True)):
        assert_distinct(labels)
        assert all(label.startswith(("in.txt", "https://h/c/in.txt")) for label in labels.values())
    # the same file spelled twice (a file:// URL and its path): one label; only colliding labels carry a digest
    assert file_labels(["/c/in.txt", "/c/out.txt"]) == {"/c/in.txt": "in.txt", "/c/out.txt": "out.txt"}
    assert file_labels(["s3://b/in.txt?versionId=1", "s3://b/out.txt"]) == {
        "s3://b/in.txt?versionId=1": redact("in.txt?versionId=1"), "s3://b/out.txt": "out.txt"}   # as redact shows it
    digest = file_labels(["s3://b/in.txt?file=a", "s3://b/in.txt?file=b"], "s3://b")
    assert all(re.fullmatch(r"in\.txt~[0-9a-f]{16}", label) for label in digest.values()), digest


def test_names_that_print_alike_get_distinct_labels():
    for files in (["/d/a\x01.txt", "/d/a\\x01.txt"], ["/d/a\udcff.txt", "/d/a\\xff.txt"],
                  ["/d/u:a@h.txt", "/d/u:b@h.txt"], ["/d/x?sig=1", "/d/x?sig=2"]):
        assert_distinct(file_labels(files))
        assert_distinct(file_labels(files, "/d"))
        assert_distinct(file_labels(files, full=True))
    assert file_labels(["/d/a\x01.txt", "/d/a\udcff.txt"]) == {"/d/a\x01.txt": "a\\x01.txt",
                                                              "/d/a\udcff.txt": "a\\xff.txt"}


# --- end to end --------------------------------------------------------------------------------------------

def run_args(tiny_model_files, out, *inputs, extra=()):
    return [*(a for i in inputs for a in ("--input", i)), "--output", str(out), "--options-file", tiny_model_files[0],
            "--weight-file", tiny_model_files[1], "--torch-threads", "1", "--progress", "off", *extra]


def ids_per_file(out) -> dict[str, list[str]]:
    """{file label: its sentence ids} from the Parquet shards, checked against the HDF5 datasets' names."""
    m = json.load(open(os.path.join(out, "manifest.json")))
    ids = sorted(parquet_rows(str(out), m))
    assert sorted(hdf5_unkey(k) for k in hdf5_arrays(str(out), m)) == ids
    by_file: dict[str, list[str]] = {}
    for i in ids:
        by_file.setdefault(i.rsplit(":", 1)[0], []).append(i)
    return by_file


@pytest.mark.slow
def test_inputs_that_differ_only_by_query_have_distinct_ids(tiny_model_files, tmp_path):
    texts = {"file=a": b"Gulls over the pier.\nThe lamp at dusk.\n", "file=b": b"A third line.\n",
             "token=s3cr3t1": b"Rain on the roof.\n", "token=s3cr3t2": b"Wind in the masts.\nSalt air.\n"}
    with ModelServer() as server:
        for query, data in texts.items():
            server.files[f"/b/in.txt?{query}"] = data
        inputs = [f"{server.url}/b/in.txt?{query}" for query in texts]
        for name, extra in (("default", ()), ("root", ("--id-root", f"{server.url}/b"))):
            for attempt in (1, 2):           # a rerun finds the run complete
                assert main(run_args(tiny_model_files, tmp_path / name, *inputs, extra=extra)) == 0, (name, attempt)
            by_file = ids_per_file(tmp_path / name)
            assert sorted(len(v) for v in by_file.values()) == [1, 1, 2, 2], by_file
            assert not any("s3cr3t" in label for label in by_file), by_file
            assert not any(open(os.path.join(tmp_path / name, p), "rb").read().count(b"s3cr3t")
                           for p in os.listdir(tmp_path / name) if p.endswith(".json"))


@pytest.mark.slow
def test_names_that_print_alike_have_distinct_ids(tiny_model_files, tmp_path):
    folder = os.fsencode(str(tmp_path / "in"))
    os.makedirs(folder)
    names = [b"a\xffb.txt", b"a\\xffb.txt", b"c\x01.txt", b"c\\x01.txt", b"u:a@h.txt", b"u:b@h.txt", b"plain.txt"]
    for n, name in enumerate(names):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(b"Line %d.\n" % n)
    out = tmp_path / "out"
    assert main(run_args(tiny_model_files, out, str(tmp_path / "in" / "*.txt"))) == 0
    by_file = ids_per_file(out)
    assert len(by_file) == len(names) and all(len(ids) == 1 for ids in by_file.values()), by_file
    assert not any(UNPRINTABLE.search(label) for label in by_file), by_file
    assert {"a\\xffb.txt", "a\\\\xffb.txt", "c\\x01.txt", "c\\\\x01.txt", "plain.txt"} <= set(by_file), by_file


def test_an_object_stores_keys_are_names_not_paths():
    """s3://b/k//a.txt, s3://b/k/a.txt and s3://b/k/x/../a.txt are three objects: each keeps its key and its own
    label in every mode; local paths and http(s) URLs are still normalised."""
    keys = ["s3://b/k//a.txt", "s3://b/k/a.txt", "s3://b/k/x/../a.txt", "gs://b/k/./a.txt"]
    assert [normalise(k) for k in keys] == keys
    assert normalise("/d//x/../a.txt") == "/d/a.txt" and normalise("https://h/d//x/../a.txt?v=1") == "https://h/d/a.txt?v=1"
    for labels in (file_labels(keys[:3]), file_labels(keys[:3], full=True), file_labels(keys[:3], "s3://b/k")):
        assert_distinct(labels)
    assert file_labels(keys[:3], full=True) == {k: k for k in keys[:3]}
