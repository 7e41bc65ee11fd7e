"""Prove that a change left the outputs of the public commands unchanged.

    python scripts/compare_outputs.py --base REV [--head REV|WORKTREE_DIR] [--out DIR] [--quick]
                                      [--allow-byte-changes]

Runs the same command lines at two revisions on the same small inputs and compares what they wrote.
BASE is checked out with `git worktree add --detach` into a temp folder (removed at the end); HEAD is
the current working tree (uncommitted changes included), a folder or a revision. Each side runs from
its tree's root with PYTHONPATH=<tree>, this Python, OMP_NUM_THREADS=1, 1 torch thread, and a
sitecustomize that drops the venv's editable-install finder (a package missing from a tree fails to
import instead of coming silently from the checkout the venv was installed from). --out DIR keeps the
inputs and both sides' outputs.

Commands (inputs made at run time from ../shared/data, or samples/sample.txt):
  elmo      `pipeline.cli elmo IN OUT.hdf5 --all` and `--top --max-tokens-per-batch 1024` on 40
            sentences, with the shipped model and a random `model.synthetic small` model (written once
            by the base tree's code; both sides read the same files)
  pipeline  `pipeline.run --format parquet,hdf5 --shard-sentences 60` on 150 lines of WikiText-2 (raw
            tokenizer), the same with --parquet-layout token --layers 0,2 --dtype float16, the same with
            --batch-invariant --max-tokens-per-batch 16384, and JSONL
            (--tokenizer whitespace --id-field id) of 80 + 40 SST-2 sentences plus broken records
  probe     `pipeline.cli probe --epochs 2 --seeds 1 --threads 1` on the two JSONL outputs
  --quick   only elmo --all (shipped model) and the WikiText-2 pipeline run

Each side's files are first checked against their manifest's records (`files`: size and SHA-256); a file that
is not the one its run recorded is a difference. Per output: bytes (SHA-256) and content. Parquet: schema, every column exactly (nulls, list lengths,
values bit for bit, max |diff|), and which file metadata differs when only bytes do. HDF5: names,
shapes, dtypes, attributes, values bit for bit. manifest.json / results.json: equal with each side's
tree and output folder replaced by <TREE>/<OUT>, timings (and results.json `machine`) dropped, and the manifest's
records of the files that hold timings (metrics.prom, report.html, ...: TIMED_RECORDS) dropped; manifest
keys only the head has are reported as "keys added (an extension)";
`run.key` / `options.*` differences are reported as "differs (expected if flags were added)", not as
failures. table.md: without its `seconds` column. metrics.prom: without the output and run_key labels
and the `*_seconds` samples. Dead letters: sorted lines. chart.png and report.html
(renderings of the run's timings, different every run): not compared.

Reproducibility (runs of one revision): Parquet (zstd) and HDF5 files are byte-identical run to run
(h5py stores no timestamps by default), so their bytes must match unless --allow-byte-changes
(performance work; content must still be equal). Dead-letter files are NOT: WriteDeadLetters writes
them in bundle arrival order, which varies (3 dead letters came in 2 orders over 5 runs), so their
sorted lines are compared. manifest.json, results.json and table.md hold paths and timings: content only.
Exit status: 0 all equal, 1 a difference, 2 a command failed.
"""
from __future__ import annotations

import argparse, hashlib, json, math, os, re, shutil, subprocess, sys, tempfile, time
from pathlib import Path

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

GUARD = ("import sys\nsys.meta_path[:] = [f for f in sys.meta_path\n"
         "                 if not getattr(f, '__module__', '').startswith('__editable__')]\n")
PIPE = ["-m", "pipeline.run", "--torch-threads", "1", "--progress", "off", "--format", "parquet,hdf5",
        "--shard-sentences", "60"]
JSONL = ["--input-format", "jsonl", "--tokenizer", "whitespace", "--id-field", "id"]
TIMING = re.compile(r"(seconds|elapsed|duration|timestamp|_time|^time)$")
# A manifest's records (size, SHA-256) of the files that hold the run's timings: they differ every run (the files
# themselves are compared without their timings, below)
TIMED_RECORDS = tuple(f"files.{name}." for name in ("metrics.prom", "report.html", "results.json", "table.md",
                                                     "chart.png"))
BROKEN = ['{"id": "bad-json", "text": \n', '{"id": "no-text"}\n', '{"id": "blank", "text": "  "}\n',
          json.dumps({"id": "too-long", "text": " ".join(["word"] * 120)}) + "\n"]


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def make_inputs(work: Path, repo: Path) -> dict:
    """Inputs both sides read: elmo sentences, WikiText-2 text, SST-2 JSONL and labels."""
    data = repo.parent / "shared" / "data"
    wiki = data / "wikitext-2" / "valid.txt"
    lines = (wiki if wiki.exists() else repo / "samples" / "sample.txt").read_text("utf-8").splitlines(True)
    sents = [" ".join(s.split()) for line in lines if line.strip() and not line.strip().startswith("=")
             for s in re.split(r"(?<= \.) |(?<=\.) (?=[A-Z])", line.strip()) if len(s.split()) >= 3]
    files = {"sent": "sentences.txt", "wiki": "wikitext150.txt"}
    (work / files["sent"]).write_text("\n".join(sents[:40]) + "\n", "utf-8")
    (work / files["wiki"]).write_text("".join(lines[:150]), "utf-8")
    for split, n in (("train", 80), ("dev", 40)):
        src = data / "sst2" / f"stsa.binary.{split}"
        pairs = ([ln.split(" ", 1) for ln in src.read_text("utf-8").splitlines()[:n]] if src.exists()
                 else [(str(i % 2), s) for i, s in enumerate(sents[:n])])
        rows = [json.dumps({"id": f"{split}-{i:06d}", "text": t, "label": int(lab)}) + "\n"
                for i, (lab, t) in enumerate(pairs, 1)]
        files[split], files[f"labels_{split}"] = f"sst_{split}.jsonl", f"labels_{split}.jsonl"
        (work / files[f"labels_{split}"]).write_text("".join(rows), "utf-8")
        (work / files[split]).write_text("".join(rows + (BROKEN if split == "train" else [])), "utf-8")
    return {k: str(work / f) for k, f in files.items()}


def commands(i: dict, synth: Path | None, quick: bool) -> list[tuple[str, list[str]]]:
    """(output name, argv after `python`); {out} stands for the side's output folder."""
    elmo = [("elmo-all.hdf5", ["--all"]), ("elmo-top.hdf5", ["--top", "--max-tokens-per-batch", "1024"])]
    models = [("", [])] + ([("synthetic-", ["--options-file", f"{synth}/options.json",
                                            "--weight-file", f"{synth}/weights.hdf5"])] if synth else [])
    cmds = [(m + name, ["-m", "pipeline.cli", "elmo", i["sent"], "{out}/" + m + name, *flags, *mflags])
            for m, mflags in models for name, flags in elmo]
    cmds += [("pipe-text", [*PIPE, "--input", i["wiki"], "--output", "{out}/pipe-text"]),
             ("pipe-token-f16", [*PIPE, "--input", i["wiki"], "--output", "{out}/pipe-token-f16",
                                 "--parquet-layout", "token", "--layers", "0,2", "--dtype", "float16"]),
             ("pipe-invariant", [*PIPE, "--input", i["wiki"], "--output", "{out}/pipe-invariant", "--batch-invariant",
                                 "--max-tokens-per-batch", "16384"]),
             ("pipe-jsonl-train", [*PIPE, "--input", i["train"], "--output", "{out}/pipe-jsonl-train", *JSONL,
                                   "--max-sentence-tokens", "100"]),
             ("pipe-jsonl-dev", [*PIPE, "--input", i["dev"], "--output", "{out}/pipe-jsonl-dev", *JSONL]),
             ("probe", ["-m", "pipeline.cli", "probe", "--train", "{out}/pipe-jsonl-train", "--dev",
                        "{out}/pipe-jsonl-dev", "--labels", i["labels_train"], "--labels", i["labels_dev"],
                        "--epochs", "2", "--seeds", "1", "--threads", "1", "--quiet", "--out", "{out}/probe"])]
    return [c for c in cmds if c[0] in ("elmo-all.hdf5", "pipe-text")] if quick else cmds


def side_env(tree: Path, guard: Path) -> dict:
    return {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{guard}", "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def make_synthetic(trees: tuple[Path, Path], dest: Path, guard: Path) -> Path | None:
    """A random `small` biLM, written once by the base tree's code (the head's if base lacks it)."""
    for tree in trees:
        if subprocess.run([sys.executable, *qualified(tree, ["-m", "model.synthetic"]), "small", str(dest)], cwd=tree,
                          env=side_env(tree, guard), capture_output=True).returncode == 0:
            return dest
    print("note: `python -m model.synthetic` failed in both trees: synthetic-model runs skipped", flush=True)
    return None


def qualified(tree: Path, argv: list[str]) -> list[str]:
    """argv with `-m MODULE` under the tree's import name: elmo_pipeline.MODULE where the tree has that package
    (older trees import their top-level folders directly)."""
    if not (tree / "elmo_pipeline" / "__init__.py").exists():
        return list(argv)
    return [f"elmo_pipeline.{a}" if i and argv[i - 1] == "-m" else a for i, a in enumerate(argv)]


def run_side(tree: Path, out: Path, cmds: list, guard: Path) -> list[str]:
    """Run every command from `tree`'s root; returns the failures."""
    out.mkdir(parents=True)
    failures = []
    for name, argv in cmds:
        t = time.time()
        p = subprocess.run([sys.executable, *[a.replace("{out}", str(out)) for a in qualified(tree, argv)]], cwd=tree,
                           env=side_env(tree, guard), capture_output=True, text=True)
        print(f"  {name}: {'ok' if p.returncode == 0 else 'FAILED'} ({time.time() - t:.1f} s)", flush=True)
        if p.returncode:
            failures.append(f"{name} (exit {p.returncode}): {p.stderr.strip()[-800:]}")
    return failures


def cmp_numbers(a: np.ndarray, b: np.ndarray) -> tuple[bool, float]:
    """Bit-for-bit equality and max |diff| (nan when the shapes differ)."""
    same = a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if a.shape != b.shape or a.dtype.kind not in "fiub" or b.dtype.kind not in "fiub":
        return same, (0.0 if same else math.nan)
    return same, float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0))


def worse(d1: float, d2: float) -> float:
    return math.nan if math.isnan(d1) or math.isnan(d2) else max(d1, d2)


def cmp_column(x: pa.Array, y: pa.Array) -> tuple[bool, float]:
    """Nulls and list lengths at every nesting level, then the leaf values bit for bit."""
    while True:
        if x.null_count != y.null_count or not x.is_null().equals(y.is_null()):
            return False, math.nan
        if not (pa.types.is_list(x.type) or pa.types.is_large_list(x.type) or pa.types.is_fixed_size_list(x.type)):
            break
        if not pa.types.is_fixed_size_list(x.type) and not x.value_lengths().equals(y.value_lengths()):
            return False, math.nan
        x, y = x.flatten(), y.flatten()
    if pa.types.is_integer(x.type) or pa.types.is_floating(x.type):
        return cmp_numbers(x.to_numpy(zero_copy_only=False), y.to_numpy(zero_copy_only=False))
    return x.equals(y), 0.0


def cmp_parquet(a: Path, b: Path) -> tuple[bool, float, str]:
    fa, fb = pq.ParquetFile(a), pq.ParquetFile(b)
    ta, tb = fa.read(), fb.read()
    if not ta.schema.equals(tb.schema, check_metadata=False) or ta.num_rows != tb.num_rows:
        fields = sorted({str(f) for f in ta.schema} ^ {str(f) for f in tb.schema})
        return False, math.nan, f"schema or row count differs: {fields[:4]}, {ta.num_rows} vs {tb.num_rows} rows"
    same, worst, bad = True, 0.0, []
    for name in ta.column_names:
        ok, d = cmp_column(ta[name].combine_chunks(), tb[name].combine_chunks())
        same, worst, bad = same and ok, worse(worst, d), bad + ([] if ok else [name])
    codecs = [[m.row_group(r).column(c).compression for r in range(m.num_row_groups) for c in range(m.num_columns)]
              for m in (fa.metadata, fb.metadata)]
    meta = [k for k, va, vb in (("schema metadata", ta.schema.metadata, tb.schema.metadata),
                                ("created_by", fa.metadata.created_by, fb.metadata.created_by),
                                ("row groups", fa.metadata.num_row_groups, fb.metadata.num_row_groups),
                                ("compression", *codecs)) if va != vb]
    notes = (["columns differ: " + ", ".join(bad)] * bool(bad)
             + ["file metadata differs: " + ", ".join(meta)] * bool(meta))
    return same, worst, "; ".join(notes)


def cmp_hdf5(a: Path, b: Path) -> tuple[bool, float, str]:
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        oa, ob = {"/": fa}, {"/": fb}
        fa.visititems(oa.__setitem__), fb.visititems(ob.__setitem__)
        if oa.keys() != ob.keys():
            return False, math.nan, f"names differ, e.g. {sorted(oa.keys() ^ ob.keys())[:3]}"
        same, worst, bad, layout = True, 0.0, [], []
        for name, x in oa.items():
            y = ob[name]
            ok = sorted(x.attrs) == sorted(y.attrs) and all(np.array_equal(x.attrs[k], y.attrs[k]) for k in x.attrs)
            ok2, d = isinstance(x, h5py.Dataset) == isinstance(y, h5py.Dataset), 0.0
            if ok2 and isinstance(x, h5py.Dataset):
                va, vb = np.asarray(x[()]), np.asarray(y[()])
                ok2, d = (cmp_numbers(va, vb) if x.dtype.kind in "fiub" else
                          (x.shape == y.shape and x.dtype == y.dtype and np.array_equal(va, vb), 0.0))
                layout += [] if (x.chunks, x.compression) == (y.chunks, y.compression) else [name]
            same, worst, bad = same and ok and ok2, worse(worst, d), bad + ([] if ok and ok2 else [name])
    notes = ([f"{len(bad)} datasets differ, e.g. {bad[:3]}"] * bool(bad)
             + [f"storage layout differs: {layout[:3]}"] * bool(layout))
    return same, worst, "; ".join(notes)


def flat(obj, prefix: str = "") -> dict:
    """{"a.b.0.c": value}; lists of scalars stay values."""
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in flat(val, f"{prefix}{key}.").items()}
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        return {k: v for n, val in enumerate(obj) for k, v in flat(val, f"{prefix}{n}.").items()}
    return {prefix[:-1]: obj}


def cmp_json(a: Path, b: Path, subs_a: list, subs_b: list) -> tuple[bool, float, str]:
    """Flattened JSON, with <OUT>/<TREE> for each side's folders and without timings."""
    raw, norm = [], []
    for path, subs in ((a, subs_a), (b, subs_b)):
        text = path.read_text("utf-8")
        raw.append(flat(json.loads(text)))
        for old, new in subs:
            text = text.replace(json.dumps(old)[1:-1], new)
        norm.append({k: v for k, v in flat(json.loads(text)).items()
                     if not TIMING.search(k.rsplit(".", 1)[-1]) and k != "meta.machine"
                     and not k.startswith(TIMED_RECORDS)})
    absent = object()
    diff = sorted(k for k in norm[0].keys() | norm[1].keys() if norm[0].get(k, absent) != norm[1].get(k, absent))
    ignored = [k for k in sorted(raw[0].keys() | raw[1].keys())
               if raw[0].get(k, absent) != raw[1].get(k, absent) and k not in diff]
    expected = [k for k in diff if a.name == "manifest.json" and (k == "run.key" or k.startswith("options."))]
    added = [k for k in diff if k not in norm[0] and k not in expected]     # new keys only: an extension
    diff = [k for k in diff if k not in expected and k not in added]
    notes = (["keys differ: " + ", ".join(diff[:8])] * bool(diff)
             + ["keys added (an extension): " + ", ".join(added[:8])] * bool(added)
             + ["differs (expected if flags were added): " + ", ".join(expected)] * bool(expected)
             + [f"ignored (paths, timings): {', '.join(ignored[:6])}{' ...' * (len(ignored) > 6)}"] * bool(ignored))
    return not diff, 0.0, "; ".join(notes)


def table_without_seconds(path: Path) -> list[str]:
    """The lines of a Markdown file, each table without its `seconds` column."""
    out, drop = [], []
    for line in path.read_text("utf-8").splitlines():
        cells = line.split("|")
        if line.startswith("|") and not (out and out[-1].startswith("|")):   # a table's header row
            drop = [i for i, c in enumerate(cells) if c.strip() == "seconds"]
        out.append("|".join(c for i, c in enumerate(cells) if i not in drop) if line.startswith("|") else line)
    return out


def metrics_without_timings(path: Path) -> list[str]:
    """A metrics.prom textfile's lines without the output-folder and run-key labels (the run key hashes every
    flag: it differs when flags were added, as the manifest's run.key) and without the timing samples (metric
    names ending in _seconds)."""
    out = []
    for line in path.read_text("utf-8").splitlines():
        line = re.sub(r'(output|run_key)="[^"]*",?', "", line)
        if not re.match(r"(# (HELP|TYPE) )?\w+_seconds\b", line):
            out.append(line)
    return out


def compare_output(name: str, a: list[Path], b: list[Path], subs_a: list, subs_b: list) -> tuple:
    """(bytes equal, bytes must be equal, content equal, max |diff|, note) of one output."""
    digest = lambda ps: [hashlib.sha256(p.read_bytes()).hexdigest() for p in ps]  # noqa: E731
    same_bytes = digest(a) == digest(b)
    if name.endswith("*.jsonl"):   # dead letters: files per Beam bundle, lines in arrival order
        lines = [sorted(ln for p in ps for ln in p.read_text("utf-8").splitlines()) for ps in (a, b)]
        return same_bytes, False, lines[0] == lines[1], 0.0, "order varies run to run: lines compared sorted"
    a, b = a[0], b[0]
    if name.endswith(".json"):
        return (same_bytes, False, *cmp_json(a, b, subs_a, subs_b))
    if name.endswith("table.md"):
        return same_bytes, False, table_without_seconds(a) == table_without_seconds(b), 0.0, "seconds column dropped"
    if name.endswith("metrics.prom"):
        return (same_bytes, False, metrics_without_timings(a) == metrics_without_timings(b), 0.0,
                "output and run_key labels and *_seconds samples dropped")
    if same_bytes or not name.endswith((".parquet", ".hdf5")):
        return same_bytes, True, same_bytes, 0.0 if same_bytes else math.nan, ""
    return (False, True, *(cmp_parquet if name.endswith(".parquet") else cmp_hdf5)(a, b))


def not_as_recorded(folder: Path) -> list[str]:
    """The files under `folder` that are not the ones their output's manifest.json records (`files`: size and
    SHA-256, as the run wrote them): a comparison reads what each side's run wrote, not a file swapped in."""
    bad = []
    for manifest in sorted(folder.rglob("manifest.json")):
        try:
            files = json.loads(manifest.read_text("utf-8")).get("files")
        except (ValueError, RecursionError, AttributeError):
            files = None
        if not isinstance(files, dict):
            bad.append(f"{manifest.relative_to(folder)} (no files record)")
            continue
        for name, rec in files.items():
            f = manifest.parent / name
            inside = not Path(name).is_absolute() and ".." not in Path(name).parts
            if not (inside and isinstance(rec, dict) and f.is_file() and not f.is_symlink()
                    and f.stat().st_size == rec.get("bytes")):
                bad.append(f"{manifest.parent.relative_to(folder)}/{name}")
                continue
            digest = hashlib.sha256()
            with open(f, "rb") as stream:
                for block in iter(lambda: stream.read(1 << 20), b""):
                    digest.update(block)
            if digest.hexdigest() != rec.get("sha256"):
                bad.append(str(f.relative_to(folder)))
    return bad


def report(work: Path, trees: dict, allow_bytes: bool, seconds: float) -> int:
    """Print one row per output; 0 when every output is equal."""
    outputs = {side: {} for side in trees}   # side -> output name -> files (dead letters of a run: one output)
    for side in trees:
        for f in sorted((work / side).rglob("*")):
            if f.is_file() and f.name not in ("chart.png", "report.html"):
                rel = str(f.relative_to(work / side))
                name = re.sub(r"dead_letters/part-\d+-of-\d+\.jsonl$", "dead_letters/*.jsonl", rel)
                outputs[side].setdefault(name, []).append(f)
    ob, oh = outputs["base"], outputs["head"]
    subs = {s: [(str(work / s), "<OUT>"), (str(t), "<TREE>")] for s, t in trees.items()}
    rows, bad = [], []
    for side in trees:
        for name in not_as_recorded(work / side):
            rows.append((name, "-", "NO", "", f"{side}: not the file its manifest records (size or SHA-256)"))
            bad.append(f"{side}:{name}")
    for name in sorted(ob.keys() | oh.keys()):
        if name not in oh:
            rows.append((name, "-", "MISSING", "", "only in base"))
            bad.append(name)
            continue
        if name not in ob:          # a new output file beside unchanged ones: an extension, as added manifest keys
            rows.append((name, "-", "added", "", "only in head (an extension)"))
            continue
        same_b, strict, same_c, d, note = compare_output(name, ob[name], oh[name], subs["base"], subs["head"])
        bytes_fail = strict and not same_b and not allow_bytes
        if bytes_fail and same_c:
            note = "; ".join([note] * bool(note) + ["content equal, bytes differ (--allow-byte-changes)"])
        bad += [name] if bytes_fail or not same_c else []
        rows.append((name, "yes" if same_b else ("NO" if bytes_fail else "no"), "yes" if same_c else "NO",
                     f"{d:.3g}" if name.endswith((".parquet", ".hdf5")) else "", note))
    header = ("output", "bytes equal", "content equal", "max |diff|", "note")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(4)]
    for r in [header] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4])
    verdict = f"{len(bad)} DIFFER: {', '.join(bad)}" if bad else "ALL EQUAL"
    print(f"\n{len(rows)} outputs compared in {seconds:.0f} s: {verdict}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="git revision to compare against")
    p.add_argument("--head", help="revision or worktree folder (default: the current working tree)")
    p.add_argument("--out", help="keep inputs and outputs in this folder (default: a temp folder, removed)")
    p.add_argument("--quick", action="store_true", help="elmo --all and one pipeline run only")
    p.add_argument("--allow-byte-changes", action="store_true", help="Parquet/HDF5 bytes may differ, content not")
    args = p.parse_args(argv)
    repo = Path(git("rev-parse", "--show-toplevel", cwd=Path.cwd()))
    tmp = Path(tempfile.mkdtemp(prefix="compare-outputs-"))
    work, guard, checkouts = Path(args.out).resolve() if args.out else tmp / "out", tmp / "guard", []

    def checkout(rev: str, name: str) -> Path:
        git("worktree", "add", "--detach", str(tmp / name), rev, cwd=repo)
        checkouts.append(tmp / name)
        return tmp / name

    t0 = time.time()
    try:
        base = checkout(args.base, "base")
        head = (Path(args.head).resolve() if args.head and Path(args.head).is_dir()
                else checkout(args.head, "head") if args.head else repo)
        for d in (work, guard):
            d.mkdir(parents=True, exist_ok=True)
        (guard / "sitecustomize.py").write_text(GUARD)
        inputs = make_inputs(work, repo)
        synth = None if args.quick else make_synthetic((base, head), work / "synthetic-small", guard)
        cmds, failures = commands(inputs, synth, args.quick), []
        for side, tree in (("base", base), ("head", head)):
            dirty = ", uncommitted changes" if git("status", "--porcelain", cwd=tree) else ""
            print(f"{side}: {tree} ({git('rev-parse', '--short', 'HEAD', cwd=tree)}{dirty})", flush=True)
            shutil.rmtree(work / side, ignore_errors=True)
            failures += [f"{side}: {f}" for f in run_side(tree, work / side, cmds, guard)]
        if failures:
            print("command failures:\n  " + "\n  ".join(failures))
            return 2
        return report(work, {"base": base, "head": head}, args.allow_byte_changes, time.time() - t0)
    finally:
        for tree in checkouts:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=repo, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
