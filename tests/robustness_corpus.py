"""A bad-input corpus, a pipeline run over it, and the accounting check: every input line is a document
(whose sentences are written or dead-lettered), a blank record, or a record dead letter.

    .venv/bin/python -m tests.robustness_corpus --out /tmp/robust            # shipped default model
    .venv/bin/python -m tests.robustness_corpus --out /tmp/robust --tiny     # tiny random model (seconds)

builds <out>/corpus/*.txt (../shared/data/robustness: blns.txt and pud.*.txt when present, plus the
generated cases in GENERATED), runs `pipeline.run` into <out>/result and prints input / output /
dead-letter counts by reason. tests/test_robustness.py runs the same with the tiny model.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED_ROBUSTNESS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "data", "robustness")
PUD_LANGS = ("en", "de", "ru", "ar", "zh", "hi", "th")
LONG_SENTENCE_TOKENS = 10_000
MB_LINE_CHARS = 1 << 20


def _long_sentence(n: int) -> str:
    """n tokens without sentence punctuation (one sentence for blingfire, n tokens for Moses)."""
    words = "the river carried old boats past quiet towns while children watched from stone bridges".split()
    return " ".join(f"{words[i % len(words)]}{i // len(words) % 7 or ''}" for i in range(n))


def generated_cases() -> dict[str, bytes]:
    """file name -> bytes of the generated bad-input cases."""
    return {
        "empty.txt": b"",
        "blank_lines.txt": "\n \n\t\t\n   \n\u3000\n\u2028\n\x0b\x0c\n".encode(),
        "crlf.txt": b"First line with CRLF.\r\nSecond line, also CRLF.\r\n\r\nLast line without a newline.",
        "bom.txt": "\ufeffHello after a byte-order mark.\nA second line.\n".encode(),
        "nul.txt": b"a\x00b c. Next sentence.\n\x00\x00\x00\nText with a NUL\x00 inside it.\n",
        "invalid_utf8.txt": (b"A valid line.\n\xff\xfe not UTF-8 at all\nvalid again\n\xc3\x28 bad continuation\n"
                             b"caf\xc3\xa9 is fine\nan overlong \xc0\xaf slash\ntruncated at the end \xe2\x82"),
        "controls.txt": ("\x01\x02\x03\x04\n\x1b[31m\x07\n\u200b\u200c\u200d\n\u2060\ufeff\n"
                         "\x07bell and \x1b[0mescape codes\n\u202eright-to-left override\n").encode(),
        "long_tokens.txt": (" ".join(["x" * 51, "y" * 200, "https://example.com/" + "a/b-c_d" * 40,
                                      "Ü" * 60, "\U0001F600" * 30]) + "\n").encode(),
        "mb_line.txt": (("abcdefghij" * (MB_LINE_CHARS // 10 + 1))[:MB_LINE_CHARS] + "\n").encode(),
        "long_sentence.txt": (_long_sentence(LONG_SENTENCE_TOKENS) + "\n").encode(),
        "many_unk.txt": (" ".join(["<unk>"] * 1500) + " ends here .\n").encode(),
    }


def build(out: str, shared: str | None = SHARED_ROBUSTNESS, pud_lines: int | None = None) -> list[str]:
    """Write the corpus into <out>/corpus; returns its files. pud_lines: only the first N lines of each PUD file."""
    corpus = os.path.join(out, "corpus")
    os.makedirs(corpus, exist_ok=True)
    files = dict(generated_cases())
    if shared and os.path.isdir(shared):
        with open(os.path.join(shared, "blns.txt"), "rb") as f:
            files["blns.txt"] = f.read()
        for lang in PUD_LANGS:
            with open(os.path.join(shared, f"pud.{lang}.txt"), "rb") as f:
                data = f.read()
            if pud_lines is not None:
                data = b"".join(data.splitlines(keepends=True)[:pud_lines])
            files[f"pud.{lang}.txt"] = data
    for name, data in files.items():
        with open(os.path.join(corpus, name), "wb") as f:
            f.write(data)
    return sorted(os.path.join(corpus, n) for n in files)


def input_lines(path: str) -> list[bytes]:
    """A file's lines as the pipeline counts them: split on b"\\n", a final newline adds no line."""
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    return lines[:-1] if lines and lines[-1] == b"" else lines


def is_blank(raw: bytes, first: bool) -> bool:
    raw = raw[:-1] if raw.endswith(b"\r") else raw
    raw = raw[3:] if first and raw.startswith(b"\xef\xbb\xbf") else raw
    try:
        return not raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return False


def run(out: str, files: list[str], model_files: tuple[str, str] | None = None, *extra: str) -> dict:
    """Run the pipeline on `files` into <out>/result; returns the manifest."""
    from elmo_pipeline.pipeline.run import run as run_pipeline
    result_dir = os.path.join(out, "result")
    argv = [a for f in files for a in ("--input", f)] + ["--output", result_dir, "--overwrite", "--progress", "off"]
    if model_files:
        argv += ["--options-file", model_files[0], "--weight-file", model_files[1]]
    run_pipeline(argv + list(extra))
    with open(os.path.join(result_dir, "manifest.json")) as f:
        return json.load(f)


def account(out: str, files: list[str], manifest: dict) -> dict:
    """Check that every input line is accounted for; returns the figures. AssertionError names a gap."""
    import pyarrow.dataset as ds
    result_dir = os.path.join(out, "result")
    c = manifest["counts"]
    labels = {f: os.path.basename(f) for f in files}
    line_ids, blank_ids = set(), set()
    for f in files:
        for n, raw in enumerate(input_lines(f), 1):
            line_ids.add(f"{labels[f]}:{n}")
            if is_blank(raw, n == 1):
                blank_ids.add(f"{labels[f]}:{n}")
    dead = []
    for d in manifest["dead_letter_files"]:
        with open(os.path.join(result_dir, d["path"]), encoding="utf-8") as fh:
            dead += [json.loads(line) for line in fh]
    record_dead = {d["id"] for d in dead if d["level"] == "record"}
    sentence_dead = [d for d in dead if d["level"] == "sentence"]
    parquet = [os.path.join(result_dir, s["parquet"]) for s in manifest["shards"]]
    table = ds.dataset(parquet, format="parquet").to_table(columns=["id", "doc_id"]) if parquet else None
    written_ids = table.column("id").to_pylist() if table is not None else []
    doc_ids = set(table.column("doc_id").to_pylist()) if table is not None else set()
    doc_ids |= {d["id"].rsplit("#", 1)[0] for d in sentence_dead}
    by_reason: dict[str, int] = {}
    for d in dead:
        k = d["reason"].split(":", 1)[0]
        by_reason[k] = by_reason.get(k, 0) + 1

    assert c["input_records"] == len(line_ids), (c["input_records"], len(line_ids))
    assert c["blank_records"] == len(blank_ids), (c["blank_records"], len(blank_ids))
    assert c["input_records"] == c["documents"] + c["blank_records"] + c["record_dead_letters"], c
    assert c["sentences"] == c["sentences_written"] + c["dead_letter_sentences"], c
    assert c["sentences_written"] == len(written_ids) == len(set(written_ids))
    assert c["dead_letters"] == len(dead) and c["record_dead_letters"] == len(record_dead)
    assert c["dead_letter_sentences"] == len(sentence_dead)
    assert c["dead_letters_by_reason"] == dict(sorted(by_reason.items())), (c["dead_letters_by_reason"], by_reason)
    # every document has >= 1 sentence written or dead-lettered; the lines partition exactly
    assert len(doc_ids) == c["documents"], (len(doc_ids), c["documents"])
    assert doc_ids | blank_ids | record_dead == line_ids
    assert not (doc_ids & blank_ids) and not (doc_ids & record_dead) and not (blank_ids & record_dead)
    return {"input_lines": len(line_ids), "blank_records": len(blank_ids), "documents": c["documents"],
            "record_dead_letters": len(record_dead), "sentences": c["sentences"],
            "sentences_written": c["sentences_written"], "tokens_written": c["tokens_written"],
            "dead_letter_sentences": c["dead_letter_sentences"], "dead_letters_by_reason": by_reason}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.robustness_corpus", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for corpus/ and result/")
    p.add_argument("--tiny", action="store_true", help="a tiny random biLM instead of the shipped default model")
    p.add_argument("--pud-lines", type=int, default=None, help="only the first N lines of each PUD file")
    p.add_argument("--torch-threads", default="1")
    args, extra = p.parse_known_args(argv)
    files = build(args.out, pud_lines=args.pud_lines)
    model = None
    if args.tiny:
        from elmo_pipeline.model.synthetic import write_random_bilm
        model = write_random_bilm("tiny", os.path.join(args.out, "tiny"), seed=1)
    t0 = time.perf_counter()
    manifest = run(args.out, files, model, "--torch-threads", args.torch_threads, *extra)
    secs = time.perf_counter() - t0
    figures = account(args.out, files, manifest)
    size = sum(os.path.getsize(f) for f in files)
    print(f"corpus: {len(files)} files, {size:,} bytes in {args.out}/corpus "
          f"({'with' if glob.glob(os.path.join(args.out, 'corpus', 'pud.*')) else 'without'} ../shared robustness files)")
    print(f"input lines {figures['input_lines']} = documents {figures['documents']} + blank records "
          f"{figures['blank_records']} + record dead letters {figures['record_dead_letters']}")
    print(f"sentences {figures['sentences']} = written {figures['sentences_written']} + dead letters "
          f"{figures['dead_letter_sentences']}; tokens written {figures['tokens_written']}")
    print("dead letters by reason: " + ", ".join(f"{k} {v}" for k, v in sorted(figures["dead_letters_by_reason"].items())))
    print(f"accounting: every input line accounted for exactly once; pipeline {secs:.1f} s -> {args.out}/result")
    return 0


if __name__ == "__main__":
    sys.exit(main())
