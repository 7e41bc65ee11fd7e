"""The pipeline's graph, one labelled chain that only stages data under <out>/_staging/<run key>/ (the step
labels, top to bottom; [optional], {alternatives}; tests/test_graph_map.py holds this map to the code):

    ListFiles -> SpreadFiles -> ReadFiles                      read elements (files or parts of them); per-file
                                                               (or per-part) record counts staged
    -> {KeyById -> GroupById -> DropDuplicateIds (--id-field) | [SpreadDocuments] (a reshuffle)
        | KeyByBucket -> SpreadDocuments -> Ungroup (runners whose reshuffle moves nothing)}
    -> [SkipUnchanged] (--iceberg-mode upsert) -> Tokenize -> [SkipCommitted] (resuming)
    -> [KeyBySentence -> GroupBySentence -> OneOfEach] (--dedupe)
    -> [KeyForReuse, ListKeyIndexes -> SpreadKeyIndexes -> ReadKeyIndexes -> JoinReused -> MatchReused
        -> {NotReused | Reused -> GroupBySourceShard -> CopyReused}] (--reuse)
    -> EmbedShards (SortAndBatch, EmbedBatches, WriteShards in one step: shards and their commit records)
    -> [AllShards] -> CountStagedShards

Every step stages the dead letters it finds itself (transforms/chain.py). Finalize runs after the graph, in
the launching process (output/lifecycle.py).
"""
from __future__ import annotations

import zlib

from elmo_pipeline.pipeline.quiet import quiet_beam

quiet_beam()   # before Beam's first import, which logs notices about optional GCP libraries
import apache_beam as beam

from elmo_pipeline.formats.layout import ShardInfo
from elmo_pipeline.pipeline.plan import Plan
from elmo_pipeline.transforms import coders  # noqa: F401 - registers the element coders
from elmo_pipeline.transforms.chain import Chain
from elmo_pipeline.transforms.dedupe import one_of_each
from elmo_pipeline.transforms.embed_step import EmbedBatches, SortAndBatch
from elmo_pipeline.transforms.read_step import DropDuplicateIds, ReadFiles, SkipUnchanged
from elmo_pipeline.transforms.reuse import NOT_FOUND, bucket_of, by_shard, index_blobs, join_buckets, join_key, match
from elmo_pipeline.transforms.reuse_step import CopyReused
from elmo_pipeline.transforms.tokenize_step import Tokenize
from elmo_pipeline.transforms.write_step import SkipCommitted, WriteShards
from elmo_pipeline.transforms.records import Document, Item
from elmo_pipeline.output.staging import Staging
from elmo_pipeline.output.state import OutputState


def build(p: beam.Pipeline, pl: Plan, state: OutputState, fence=None) -> None:
    """The graph, top to bottom: one chain of single-output steps with typed elements, ending in one leaf.
    It only stages data under state.staging (dead letters and counts as side effects of the steps that
    find them); Finalize runs after it (pipeline/execute.py). With pl.break_fusion every stage boundary is a
    Reshuffle, so every element is encoded and decoded with its coder (transforms/coders.py) on every runner.
    `fence` (output.lease.Fence of the run's lease) is checked before every staged write on the workers."""
    o, so = pl.options, pl.storage_options
    staging = Staging(state.staging, so, fence)

    def stage(pcoll, label, *dofns, output_type):
        out = pcoll | label >> beam.ParDo(Chain(staging, *dofns)).with_output_types(output_type)
        return out | f"{label}Encoded" >> beam.Reshuffle() if pl.break_fusion else out

    files = p | "ListFiles" >> beam.Create(range(len(pl.splits or pl.files))) | "SpreadFiles" >> beam.Reshuffle()
    docs = stage(files, "ReadFiles", ReadFiles(o.input_format, pl.files, pl.labels, o.text_field, o.id_field, so,
                                               staging, pl.progress, o.max_record_bytes, pl.splits or None,
                                               pl.fingerprints),
                 output_type=Document)
    if pl.unique_ids:          # grouping by id also spreads the documents over workers
        keyed = docs | "KeyById" >> beam.Map(lambda d: (d.doc_id, d)).with_output_types(tuple[str, Document])
        docs = stage(keyed | "GroupById" >> beam.GroupByKey(), "DropDuplicateIds", DropDuplicateIds(pl.progress),
                     output_type=Document)
    elif pl.spread_documents and not pl.break_fusion:
        docs = spread(docs, pl.spread_buckets)
    if pl.upsert is not None:  # --iceberg-mode upsert: only new and changed documents go on
        docs = stage(docs, "SkipUnchanged", SkipUnchanged(pl.upsert.state, pl.upsert.salt, staging, pl.progress),
                     output_type=Document)
    items = stage(docs, "Tokenize", Tokenize(pl.tokenizer, pl.sentence_limit, pl.limit_flag,
                                             processes=pl.tokenizer_processes, progress=pl.progress,
                                             max_document_tokens=o.max_document_tokens,
                                             key_prefix=pl.shard.key_prefix),
                  output_type=Item)
    if state.record_paths:   # resuming: drop the sentences an interrupted run of this command committed
        items = items | "SkipCommitted" >> beam.ParDo(
            SkipCommitted(state.record_paths, so, pl.progress)).with_output_types(Item)
    if pl.dedupe:            # one Item per sentence key, carrying the others as its copies (transforms/dedupe.py)
        items = (items | "KeyBySentence" >> beam.Map(lambda i: (i.key, i)).with_output_types(tuple[str, Item])
                 | "GroupBySentence" >> beam.GroupByKey()
                 | "OneOfEach" >> beam.MapTuple(lambda _, group: one_of_each(group)).with_output_types(Item))
    reused = []
    if pl.reuse:             # sentences an earlier output holds: its stored vectors (transforms/reuse.py)
        items, copied = join_reused(p, items, pl)
        reused = [copied | "CopyReused" >> beam.ParDo(Chain(
            staging, CopyReused(pl.reuse, pl.shard, so, pl.progress),
            WriteShards(staging, pl.shard, o.shard_sentences, o.shard_bytes))).with_output_types(ShardInfo)]
    # batching, embedding and writing in one step: a bundle's last batches and shard never leave it. The count
    # (unused) gives the step a consumer across a stage boundary: FnApiRunner's multi-process mode notices a
    # dead worker on that data channel, and waits forever without one (docs/runner-notes.md)
    shards = items | "EmbedShards" >> beam.ParDo(Chain(
        staging,
        SortAndBatch(o.max_tokens_per_batch, o.sort_buffer, sort=pl.sort),
        EmbedBatches(pl.spec, pl.progress, window=pl.window, overlap=o.window_overlap,
                     max_tokens=o.max_tokens_per_batch, layers=pl.shard.layers_read, threads=pl.embed_threads,
                     models=pl.models),
        WriteShards(staging, pl.shard, o.shard_sentences, o.shard_bytes))).with_output_types(ShardInfo)
    if reused:
        shards = (shards, *reused) | "AllShards" >> beam.Flatten()
    _ = shards | "CountStagedShards" >> beam.combiners.Count.Globally()


def join_reused(p: beam.Pipeline, items, pl: Plan):
    """(Items to embed, found Items grouped by source shard): the run's Items joined by key bucket (CoGroupByKey on
    the runner, transforms/reuse.py) with every row of the --reuse sources' key indexes, read one element per
    key-index file and packed per bucket."""
    so = pl.storage_options
    files = [(s, k, keys, src.records[k][0] if src.records else None, n) for s, src in enumerate(pl.reuse)
             for k, (keys, _, n) in enumerate(src.shards)]
    buckets = join_buckets(sum(n for src in pl.reuse for _, _, n in src.shards))

    def keyed(i: Item):
        k = join_key(i.key)         # the Item's sentence key, computed once where it was tokenized
        return bucket_of(k, buckets), (k, i)
    items = items | "KeyForReuse" >> beam.Map(keyed).with_output_types(tuple[int, tuple[bytes, Item]])
    found_at = (p | "ListKeyIndexes" >> beam.Create(files) | "SpreadKeyIndexes" >> beam.Reshuffle()
                | "ReadKeyIndexes" >> beam.FlatMapTuple(lambda s, k, keys, rec, n: index_blobs(s, k, keys, buckets, so,
                                                                                               rec, n)
                                                        ).with_output_types(tuple[int, bytes]))
    matched = ({"items": items, "found": found_at} | "JoinReused" >> beam.CoGroupByKey()
               | "MatchReused" >> beam.FlatMapTuple(lambda _, g: match(g["items"], g["found"])
                                                    ).with_output_types(tuple[int, Item]))
    to_embed = matched | "NotReused" >> beam.FlatMapTuple(
        lambda loc, i: [i] if loc == NOT_FOUND else []).with_output_types(Item)
    copied = (matched | "Reused" >> beam.FlatMapTuple(lambda loc, i: [by_shard(loc, i)] if loc != NOT_FOUND else []
                                                      ).with_output_types(tuple[tuple[int, int], tuple[int, Item]])
              | "GroupBySourceShard" >> beam.GroupByKey())
    return to_embed, copied


def bucket(doc_id: str, buckets: int) -> int:
    """A document's bucket for spread(): a hash of its id that is the same in every process."""
    return zlib.crc32(doc_id.encode("utf-8", "surrogatepass")) % buckets


def spread(docs, buckets: int):
    """Documents over the workers: a Reshuffle, or, where the runner's Reshuffle moves nothing (buckets > 0,
    pipeline.workers.spread_by_key: DaskRunner), a GroupByKey on bucket(doc_id) into that many buckets, each a
    bounded group (pipeline.plan.BUCKET_BYTES), then ungrouped."""
    if not buckets:
        return docs | "SpreadDocuments" >> beam.Reshuffle()
    keyed = docs | "KeyByBucket" >> beam.Map(lambda d: (bucket(d.doc_id, buckets), d)).with_output_types(
        tuple[int, Document])
    return (keyed | "SpreadDocuments" >> beam.GroupByKey()
            | "Ungroup" >> beam.FlatMap(lambda kv: kv[1]).with_output_types(Document))
