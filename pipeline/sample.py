"""The sample `--dry-run` / `elmo-pipeline plan` reads (pipeline/dry_run.py): the lines starting in up to CHUNKS
windows, about SAMPLE_BYTES in all, spread evenly over each sampled file (compressed and Parquet files: from
their start), read by the run's readers under its bounds (--max-record-bytes; DECOMPRESSED_BYTES of a file at
most), streamed, and tokenized with the run's own code; documents, sentences, tokens and dead letters scaled by
stored bytes (Parquet: rows). Reads only.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

SAMPLE_BYTES = 1 << 20          # stored bytes of the inputs read for the sample
CHUNKS = 32                     # slices per file, at most
MIN_CHUNK = 16 << 10            # bytes per slice, at least
MAX_SAMPLE_FILES = 64           # files sampled (evenly spaced by name) when there are more
COMPRESSED = (".gz", ".bz2", ".zst", ".xz", ".lzma")
DECOMPRESSED_BYTES = 16 << 20         # decompressed bytes of one file read for the sample, at most


def _window(f, start: int, end: int, block: int = 1 << 16):
    """read() of the lines that start in bytes [start, end) of a seekable binary file, streamed block by block
    (the last of them to its end, however long): every line is as likely to be in the sample whatever its
    length (no bias to short lines), and the run's line reader bounds what is held."""
    def blocks():
        pos = max(0, start - 1)
        f.seek(pos)
        if start > 0:           # lines start after a newline: the first one at or after byte start - 1
            while True:
                if pos >= end - 1:
                    return
                data = f.read(min(block, end - 1 - pos))
                if not data:
                    return
                cut = data.find(b"\n")
                pos += len(data) if cut < 0 else cut + 1
                if cut >= 0:
                    f.seek(pos)
                    break
        last = b"\n"
        while pos < end and (data := f.read(min(block, end - pos))):
            pos += len(data)
            last = data[-1:]
            yield data
        while last != b"\n" and (data := f.read(block)):      # the window's last line, to its end
            cut = data.find(b"\n")
            last = data[-1:] if cut < 0 else b"\n"
            yield data if cut < 0 else data[:cut + 1]

    pending = blocks()
    return SimpleNamespace(read=lambda n=-1: next(pending, b""))


def sample_file(url: str, size: int, budget: int, fmt: str, label: str, text_field: str, id_field: str | None,
                so: dict, take, max_record_bytes: int | None = None) -> float:
    """Reads records of the file (Document, Blank, DeadLetter) with the run's readers under its bounds and passes
    each to `take` as read (none kept here); returns the factor from them to the whole file.

    Uncompressed line files over `budget`: the lines starting in up to CHUNKS windows spread evenly over the
    file, about `budget` bytes of windows in all; other line files: from their start, until `budget` bytes as
    stored or DECOMPRESSED_BYTES decompressed (scaled by the bytes as stored read by then); Parquet:
    budget // 512 rows from the start."""
    from elmo_pipeline.fsio import open_file
    from elmo_pipeline.transforms.lines import Meter, open_decompressed
    from elmo_pipeline.transforms.read import MAX_RECORD_BYTES, line_records, read_documents
    cap = max_record_bytes or MAX_RECORD_BYTES
    if fmt == "parquet":
        taken = 0
        for r in read_documents(url, fmt, label, text_field, id_field, so, cap):
            if taken >= max(1, budget // 512):
                import pyarrow.parquet as pq
                with open_file(url, "rb", so) as f:
                    return pq.ParquetFile(f).metadata.num_rows / taken
            take(r)
            taken += 1
        return 1.0
    if size > budget and not url.endswith(COMPRESSED):
        n = max(1, min(CHUNKS, budget // MIN_CHUNK))
        width = budget // n
        with open_file(url, "rb", so) as f:
            for j in range(n):      # ids numbered in each window: the window in the label
                start = j * size // n
                w = _window(f, start, min(size, start + width))
                for r in line_records(w, Meter(w), fmt, f"{label}~{j}" if j else label, text_field, id_field,
                                      cap, whole_file=j == 0):
                    take(r)
        return size / (n * width)
    with open_decompressed(url, so) as (f, meter):
        text = Meter(f)
        for r in line_records(text, meter, fmt, label, text_field, id_field, cap):
            if (size > budget and meter.n >= budget) or text.n >= DECOMPRESSED_BYTES:
                return size / meter.n
            take(r)
    return 1.0


class Tally:
    """Counts of sampled records, as the run would count them: each Document tokenized with the run's own code,
    sentences over the limit dead letters; with an upsert (its state and salt), each document unchanged, changed
    or added, and only the changed and added ones' sentences counted (the unchanged ones' are timed too)."""

    def __init__(self, pl, keys: tuple[str, ...]):
        self.pl, self.keys, self.upsert = pl, keys, pl.upsert
        self.written, self.timing, self.seen = [], [], set()
        self.unread = False      # a file not read whole (a dead letter "unreadable file"): the run removes nothing
        self.tokenize_s, self.tokenized = 0.0, 0      # tokens of the written sentences of every document tokenized

    def __call__(self, c: dict, r, read: bool = True) -> None:
        """Count record `r` into the file's counts `c` (read: it is one of the records read)."""
        from elmo_pipeline.formats.iceberg.upsert import UNREADABLE_FILE, change_of, doc_hash
        from elmo_pipeline.tokenization.process import tokenize_or_reason
        from elmo_pipeline.transforms.records import Blank, Document
        c["input_records"] += read
        if isinstance(r, Blank):
            c["blank_records"] += 1
            return
        if not isinstance(r, Document):
            c["record_dead_letters"] += 1
            self.unread = self.unread or getattr(r, "reason", "").startswith(UNREADABLE_FILE)
            return
        c["documents"] += 1
        change = None
        if self.upsert:
            self.seen.add(r.doc_id)
            change = change_of(r.doc_id, doc_hash(r.text, r.split_sentences, self.upsert.salt), self.upsert.state)
            c[f"documents_{change}"] += 1
        t0 = time.perf_counter()
        sentences = tokenize_or_reason(r.text, self.pl.tokenizer, r.split_sentences)
        self.tokenize_s += time.perf_counter() - t0
        counted = change != "unchanged"
        if isinstance(sentences, str) or not sentences:
            c["sentences"] += counted
            c["dead_letter_sentences"] += counted
            return
        for i, s in enumerate(sentences):
            c["sentences"] += counted
            if len(s.tokens) > self.pl.sentence_limit:
                c["dead_letter_sentences"] += counted
                continue
            self.tokenized += len(s.tokens)
            w = (f"{r.doc_id}#{i}", r.doc_id, i, list(s.tokens), list(s.offsets))
            self.timing.append(w)
            if counted:
                c["sentences_written"] += 1
                c["tokens_written"] += len(s.tokens)
                self.written.append(w)


def sample_inputs(pl, sizes: dict[str, int], budget: int = SAMPLE_BYTES) -> dict:
    """Counts of the sample, scaled to all inputs, and the sample's written sentences (tokens) for timing. With
    --id-field, the sample's documents that share an id are dead letters, as in the run. With --iceberg-mode
    upsert (pl.upsert), each document is also counted unchanged, changed or added against the table's state;
    the counts of sentences and tokens are those of the changed and added ones only (the run embeds only
    those); the unchanged ones' sentences are timed too ("timing": the biLM's rate), not counted."""
    from elmo_pipeline.transforms.ids import split_duplicate_ids
    from elmo_pipeline.transforms.records import Document
    o, files = pl.options, pl.files
    picked = files if len(files) <= MAX_SAMPLE_FILES else \
        [files[round(i * (len(files) - 1) / (MAX_SAMPLE_FILES - 1))] for i in range(MAX_SAMPLE_FILES)]
    picked_bytes = sum(sizes[f] for f in picked) or 1
    total_bytes = sum(sizes.values())
    keys = ("input_records", "blank_records", "record_dead_letters", "documents", "sentences",
            "sentences_written", "tokens_written", "dead_letter_sentences") + \
        (("documents_unchanged", "documents_changed", "documents_added") if pl.upsert else ())
    tally = Tally(pl, keys)
    counts, scales, read_bytes = [], [], 0      # each file's counts, and its factor to all inputs
    by_id: dict[str, list] = {}         # --id-field: the sample's documents by id, with their file's number
    for url in picked:
        c, n = dict.fromkeys(keys, 0), len(counts)

        def take(r, c=c, n=n) -> None:
            if pl.unique_ids and isinstance(r, Document):     # counted once all ids are seen
                c["input_records"] += 1
                by_id.setdefault(r.doc_id, []).append((r, n))
            else:
                tally(c, r)
        counts.append(c)
        share = max(MIN_CHUNK, int(budget * sizes[url] / picked_bytes))
        scales.append(sample_file(url, sizes[url], share, o.input_format, pl.labels[url], o.text_field, o.id_field,
                                  pl.storage_options, take, o.max_record_bytes) * total_bytes / picked_bytes)
        read_bytes += min(sizes[url], share)
    for doc_id, group in by_id.items():
        group.sort(key=lambda g: g[0].source)       # split_duplicate_ids' order
        for r, (_, n) in zip(split_duplicate_ids(doc_id, [d for d, _ in group]), group):
            tally(counts[n], r, read=False)
    est = {k: sum(c[k] * f for c, f in zip(counts, scales)) for k in keys}
    out = {"estimated": {k: round(v) for k, v in est.items()}, "sampled": {k: sum(c[k] for c in counts) for k in keys},
           "written": tally.written, "timing": tally.timing, "tokenized_tokens": tally.tokenized,
           "tokenize_seconds": tally.tokenize_s, "sample_bytes": read_bytes, "files_sampled": len(picked)}
    if pl.upsert:      # every input document read: the table's documents the input lacks are known
        whole = len(picked) == len(files) and all(f == 1.0 for f in scales)
        out["missing"] = (0 if tally.unread else sum(d not in tally.seen for d in pl.upsert.state)) if whole else None
    return out
