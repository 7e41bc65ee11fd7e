"""Reading the pipeline's vectors back and training on them (no Beam import).

    from elmo_pipeline.downstream import ElmoOutput, ElmoDataset, ElmoIterableDataset, collate, to_arrow_table, to_hf_dataset
    from elmo_pipeline.downstream.combine import make_combiner        # layer<K> | trainable | frozen | learned

output.py: an output folder through its manifest (ElmoOutput); shard_readers.py, arrow_shards.py: one
shard's records (Parquet / HDF5 / Arrow, local or fsspec URLs); readers.py: torch datasets, collate;
tables.py: pyarrow / Hugging Face loaders; record_labels.py: labels to records; mapped.py: memory-mapped
Arrow training input (id_table.py, shard_cache.py, stream_rows.py); sampler.py: length-bucketed batches.
combine.py: layer combination modules and setting names. labels.py: label files (JSONL, TSV, CoNLL-U).
sst2.py: SST-2 files -> pipeline JSONL input. Behind `elmo-pipeline probe`: splits.py (a split's records and
batches), heads.py (classifiers), probe.py (training per setting), metrics.py (accuracy, macro-F1, majority
baseline), report.py (rows over seeds, table.md, results.json), chart.py (chart.png).
"""
from elmo_pipeline.downstream.output import ElmoOutput
from elmo_pipeline.downstream.readers import ElmoDataset, ElmoIterableDataset, collate
from elmo_pipeline.downstream.record_labels import lookup_label
from elmo_pipeline.downstream.tables import to_arrow_table, to_hf_dataset

__all__ = ["ElmoDataset", "ElmoIterableDataset", "ElmoOutput", "collate", "lookup_label", "to_arrow_table",
           "to_hf_dataset"]
