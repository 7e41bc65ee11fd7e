"""SkipUnchanged, the Beam shell of --iceberg-mode upsert's filter (formats/iceberg_upsert.py): after ReadFiles,
before Tokenize, so unchanged documents are never tokenized nor embedded."""
from __future__ import annotations

import apache_beam as beam
from apache_beam.metrics import Metrics

from elmo_pipeline.formats.iceberg_upsert import change_of, doc_hash
from elmo_pipeline.output.staging import Staging
from elmo_pipeline.transforms.chain import NS
from elmo_pipeline.transforms.progress import ProgressSpec, advance
from elmo_pipeline.transforms.records import Document


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
