"""The reading step's Beam shells: ReadFiles (a file's records, transforms.read), DropDuplicateIds
(transforms.ids.split_duplicate_ids) and SkipUnchanged (--iceberg-mode upsert: formats.iceberg.upsert), before
Tokenize, so unchanged documents are never tokenized nor embedded."""
from __future__ import annotations

import time

import apache_beam as beam
from apache_beam.metrics import Metrics

from elmo_pipeline.formats.iceberg.upsert import change_of, doc_hash
from elmo_pipeline.formats.layout import DeadLetter
from elmo_pipeline.transforms.chain import DEAD, NS
from elmo_pipeline.transforms.ids import split_duplicate_ids
from elmo_pipeline.transforms.progress import ProgressSpec, advance
from elmo_pipeline.transforms.read import MAX_RECORD_BYTES, read_documents
from elmo_pipeline.transforms.records import Blank, Document
from elmo_pipeline.transforms.splits import Split
from elmo_pipeline.fsio import redact
from elmo_pipeline.output.state import input_fingerprints
from elmo_pipeline.output.stats import RunStats
from elmo_pipeline.output.staging import Staging


class InputChanged(ValueError):
    """An input file is not the one the run was planned with (size or version): a read would mix two files."""


def check_unchanged(url: str, planned: list, storage_options: dict | None) -> None:
    """InputChanged when `url`'s [size, version] now differs from `planned` (output.state.input_fingerprints):
    checked before a read element is opened and again once it is read whole."""
    now = input_fingerprints([url], storage_options, fresh=True)[0][1:]
    if list(now) != list(planned):
        raise InputChanged(f"input {redact(url)} changed since the run was planned (size, version {planned} -> "
                           f"{now}): rerun once it no longer changes")


class ReadFiles(beam.DoFn):
    """index of a read element in `splits` (transforms.splits: a file or a part of one; default: one per file)
    -> Document ...; unreadable records to the DEAD output; per file or part, its record counts (input records,
    blank records) staged under the run's staging folder (output.staging.Staging.counts). The progress bar
    advances by the bytes that no Document carries (blank and unreadable records). Files travel by index: a
    local name that is not valid UTF-8 cannot be a Beam string."""

    def __init__(self, fmt, files, labels, text_field, id_field, storage_options, staging: Staging,
                 progress: ProgressSpec | None = None, max_record_bytes: int = MAX_RECORD_BYTES,
                 splits: list[Split] | None = None, fingerprints: dict | None = None):
        self.args = (fmt, labels, text_field, id_field, storage_options)
        self.fingerprints = dict(fingerprints or {})
        self.files, self.max_record_bytes = list(files), max_record_bytes
        self.splits = list(splits) if splits is not None else [Split(i) for i in range(len(self.files))]
        self.staging, self.progress = staging, progress
        self.docs = Metrics.counter(NS, "documents")
        self.dead = Metrics.counter(NS, "dead_letters")
        self.blank = Metrics.counter(NS, "blank_records")
        self.run_stats = RunStats()

    def process(self, index: int):
        fmt, labels, text_field, id_field, so = self.args
        split = self.splits[index]
        url = self.files[split.index]
        if url in self.fingerprints:
            check_unchanged(url, self.fingerprints[url], so)
        records = blank = doc_bytes = 0
        busy, t = 0.0, time.perf_counter()      # time reading, not the time downstream steps take per yield
        for rec in read_documents(url, fmt, labels[url], text_field, id_field, so, self.max_record_bytes, split):
            busy += time.perf_counter() - t
            records += 1
            if isinstance(rec, Blank):
                blank += 1
            elif isinstance(rec, DeadLetter):
                self.dead.inc()
                yield beam.pvalue.TaggedOutput(DEAD, rec)
            else:
                self.docs.inc()
                doc_bytes += rec.nbytes
                yield rec
            t = time.perf_counter()
        busy += time.perf_counter() - t
        if url in self.fingerprints:    # changed while it was read (appended to, rewritten in place): its records
            check_unchanged(url, self.fingerprints[url], so)    # mix two files; never counted as the planned one
        self.run_stats.time("read", busy)
        self.blank.inc(blank)
        self.staging.counts(url, {"input_records": records, "blank_records": blank},
                            None if split.whole else (split.part, split.parts))
        if self.progress:
            size = self.progress.sizes.get(url, doc_bytes) if split.whole else \
                doc_bytes if fmt == "parquet" else split.end - split.start    # a Parquet part: what its rows carry
            advance(self.progress, max(0, size - doc_bytes))


class DropDuplicateIds(beam.DoFn):
    """(doc id, its Documents) -> the Document when it is the only one; else every one of them to DEAD
    (transforms.read.split_duplicate_ids)."""

    def __init__(self, progress: ProgressSpec | None = None):
        self.dead = Metrics.counter(NS, "dead_letters")
        self.progress = progress

    def process(self, keyed):
        doc_id, docs = keyed[0], list(keyed[1])
        outs = list(split_duplicate_ids(doc_id, docs))
        if self.progress and len(docs) > 1:       # all dead letters: their input is done with
            advance(self.progress, sum(d.nbytes for d in docs))
        for out in outs:
            if isinstance(out, DeadLetter):
                self.dead.inc()
                yield beam.pvalue.TaggedOutput(DEAD, out)
            else:
                yield out


class SkipUnchanged(beam.DoFn):
    """Document -> the Document when it is new or changed against the table's state {doc_id: doc_hash}; every
    document's [doc_id, doc_hash, change] staged per bundle (output.staging.Staging.docs), so Finalize counts
    the unchanged ones and writes the table's next state. Memory: the state, about 100 bytes per document."""

    def __init__(self, state: dict[str, str], salt: str, staging: Staging, progress: ProgressSpec | None = None):
        self.state, self.salt, self.staging, self.progress = state, salt, staging, progress
        self.unchanged = Metrics.counter(NS, "documents_unchanged")

    def start_bundle(self):
        self.rows = []

    def process(self, doc: Document):
        digest = doc_hash(doc.text, doc.split_sentences, self.salt)
        change = change_of(doc.doc_id, digest, self.state)
        self.rows.append([doc.doc_id, digest, change])
        if change == "unchanged":
            self.unchanged.inc()
            advance(self.progress, doc.nbytes)       # its input is done with
        else:
            yield doc

    def finish_bundle(self):
        if self.rows:
            rows, self.rows = self.rows, []
            self.staging.docs(rows)
        return ()
