"""scripts/compare_outputs.py reads what each side's run wrote: a file that is not the one its manifest records
is a difference, whatever the other side holds."""
import hashlib
import importlib.util
import json
import os

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "compare_outputs.py")


def _script():
    spec = importlib.util.spec_from_file_location("compare_outputs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_file_not_as_its_manifest_records_is_named(tmp_path):
    out = tmp_path / "run" / "out"
    (out / "parquet").mkdir(parents=True)
    data = b"the shard as written"
    (out / "parquet" / "part-00000-of-00001.parquet").write_bytes(data)
    record = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (out / "manifest.json").write_text(json.dumps({"files": {"parquet/part-00000-of-00001.parquet": record}}))
    check = _script().not_as_recorded
    assert check(tmp_path) == []
    (out / "parquet" / "part-00000-of-00001.parquet").write_bytes(b"the shard as written, then changed")
    assert check(tmp_path) == ["run/out/parquet/part-00000-of-00001.parquet"]
    (out / "parquet" / "part-00000-of-00001.parquet").unlink()
    assert check(tmp_path) == ["run/out/parquet/part-00000-of-00001.parquet"]


def test_a_manifest_naming_outside_damaged_or_linked_files_is_named_not_followed(tmp_path):
    """A `files` entry outside the output, a link, a record that is no object, or a manifest without `files` is a
    difference (never a crash, never a file outside read)."""
    out = tmp_path / "run" / "out"
    out.mkdir(parents=True)
    secret = tmp_path / "elsewhere.txt"
    secret.write_bytes(b"x")
    record = {"bytes": 1, "sha256": hashlib.sha256(b"x").hexdigest()}
    (out / "link.txt").symlink_to(secret)
    (out / "manifest.json").write_text(json.dumps({"files": {"../../elsewhere.txt": record, "link.txt": record,
                                                             "a.txt": ["not", "a", "record"]}}))
    check = _script().not_as_recorded
    assert sorted(check(tmp_path)) == ["run/out/../../elsewhere.txt", "run/out/a.txt", "run/out/link.txt"]
    (out / "manifest.json").write_text("[" * 100_000)
    assert check(tmp_path) == ["run/out/manifest.json (no files record)"]
