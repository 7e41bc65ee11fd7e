"""Label files for the probe: sentence labels (JSONL, TSV, one label per line) and CoNLL-U token tags.

Sentence labels, by file content:
  *.jsonl / *.json   one object per line, {"id": ..., "label": ...} (field names configurable); the id is
                     a pipeline document id (e.g. the input's --id-field) or a sentence id ("<doc>#<k>")
  other text         "key<TAB>label" per line (key: sentence id, document id or input line number), or
                     just "label" per line: line n labels input line n (text/lines inputs, whose
                     ids end with ":<n>")
Token tags: CoNLL-U (*.conllu). Sentence k (1-based) is keyed by its "# sent_id = ..." comment when
present, and also by k; its tags are the UPOS column (or another) of its word lines (multi-word token
ranges "1-2" and empty nodes "1.1" are skipped, as the pipeline never sees them).

    python -m elmo_pipeline.downstream.labels conllu2jsonl treebank.conllu sentences.jsonl
writes {"id": <sent_id or 6-digit k>, "text": FORMs joined by spaces} per sentence, for
`pipeline.run --input-format jsonl --id-field id --tokenizer whitespace`.
"""
from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from collections.abc import Iterable

from elmo_pipeline.fsio import bounded_lines, keyed, open_file

CONLLU_COLUMNS = ("id", "form", "lemma", "upos", "xpos", "feats", "head", "deprel", "deps", "misc")


MAX_LINE_CHARS = 1 << 20     # a label file's line is at most this long (labels and word lines are short)


def _lines(path: str, storage_options: dict | None = None) -> Iterable[str]:
    """The lines of a label file; ValueError for a local path that is no regular file (a FIFO's open would block,
    a device's read may never end) and at a line over MAX_LINE_CHARS (never read whole)."""
    if "://" not in path or path.startswith("file://"):
        local = path.removeprefix("file://")
        if os.path.exists(local) and not stat.S_ISREG(os.stat(local).st_mode):
            raise ValueError(f"{path}: not a regular file")
    with open_file(path, "rt", keyed(path, storage_options), encoding="utf-8", newline="\n", compression="infer") as f:
        yield from bounded_lines(f, MAX_LINE_CHARS, path)


def load_sentence_labels(path: str, id_field: str = "id", label_field: str = "label",
                         storage_options: dict | None = None) -> dict[str, str]:
    """{key: label (str)} from a JSONL, TSV or one-label-per-line file (see the module docstring)."""
    out: dict[str, str] = {}
    is_json = path.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz"))
    for n, line in enumerate(_lines(path, storage_options), 1):
        if not line.strip():
            continue
        if is_json:
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                raise ValueError(f"{path}:{n}: not a JSON object") from None
            if not isinstance(rec, dict) or id_field not in rec or label_field not in rec:
                raise ValueError(f"{path}:{n}: needs fields {id_field!r} and {label_field!r}")
            key, label = str(rec[id_field]), rec[label_field]
        elif "\t" in line:
            key, label = line.split("\t", 1)
        else:
            key, label = str(n), line
        if key in out:
            raise ValueError(f"{path}:{n}: key {key!r} labelled twice")
        out[key] = str(label).strip()
    return out


def read_conllu(path: str, column: str = "upos", storage_options: dict | None = None) -> list[dict]:
    """Sentences of a CoNLL-U file: [{"sent_id": str | None, "forms": [...], "tags": [...]}]."""
    col = CONLLU_COLUMNS.index(column.lower())
    sents, cur = [], {"sent_id": None, "forms": [], "tags": []}
    for n, line in enumerate(_lines(path, storage_options), 1):
        if not line.strip():
            if cur["forms"]:
                sents.append(cur)
            cur = {"sent_id": None, "forms": [], "tags": []}
            continue
        if line.startswith("#"):
            key, _, value = line[1:].partition("=")
            if key.strip() == "sent_id":
                cur["sent_id"] = value.strip()
            continue
        fields = line.split("\t")
        if len(fields) != 10:
            raise ValueError(f"{path}:{n}: a CoNLL-U word line has 10 tab-separated fields, found {len(fields)}")
        if "-" in fields[0] or "." in fields[0]:
            continue
        cur["forms"].append(fields[1])
        cur["tags"].append(fields[col])
    if cur["forms"]:
        sents.append(cur)
    return sents


def conllu_tag_labels(sentences: list[dict]) -> dict[str, dict]:
    """{key: {"forms", "tags"}} keyed by sent_id (when present) and by 1-based sentence number."""
    out: dict[str, dict] = {}
    for k, s in enumerate(sentences, 1):
        value = {"forms": s["forms"], "tags": s["tags"]}
        out[str(k)] = value
        out[f"{k:06d}"] = value
        if s["sent_id"]:
            out[s["sent_id"]] = value
    return out


def conllu_to_jsonl(src: str, dst: str) -> int:
    sents = read_conllu(src)
    with open(dst, "w", encoding="utf-8") as f:
        for k, s in enumerate(sents, 1):
            f.write(json.dumps({"id": s["sent_id"] or f"{k:06d}", "text": " ".join(s["forms"])}, ensure_ascii=False) + "\n")
    return len(sents)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elmo_pipeline.downstream.labels")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("conllu2jsonl", help="CoNLL-U -> JSONL pipeline input (one sentence per record)")
    c.add_argument("conllu")
    c.add_argument("jsonl")
    args = p.parse_args(argv)
    n = conllu_to_jsonl(args.conllu, args.jsonl)
    print(f"{n} sentences -> {args.jsonl}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
