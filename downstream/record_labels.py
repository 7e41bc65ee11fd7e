"""Matching labels to records (batching.label_batch batches them). No Beam import.

labels: {sentence id | document id | line number: label}, as downstream/labels.py reads them from files.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

_LINE_ID = re.compile(r":(\d+)$")


def lookup_label(labels: Mapping[str, Any], record: dict) -> Any:
    """A record's label: by sentence id, else document id, else the input line number (ids of
    text inputs end with ':<line>'), else None."""
    for key in (record["id"], record["doc_id"]):
        if key in labels:
            return labels[key]
    m = _LINE_ID.search(record["doc_id"] or "")
    if m and m.group(1) in labels and record.get("sentence_index", 0) == 0:
        return labels[m.group(1)]
    return None


def attach_label(record: dict, labels: Mapping[str, Any] | None, key: str) -> dict | None:
    """Add labels[...] as record[key]; None when labels are given and this record has none."""
    if labels is None:
        return record
    value = lookup_label(labels, record)
    if value is None:
        return None
    record[key] = value
    return record


def labelled(records: Iterable[dict], labels: Mapping[str, Any], key: str) -> tuple[list[int], list]:
    """(positions of the records that have a label, in order; their labels) of `records` (attach_label)."""
    keep, values = [], []
    for p, record in enumerate(records):
        r = attach_label(record, labels, key)
        if r is not None:
            keep.append(p)
            values.append(r[key])
    return keep, values
