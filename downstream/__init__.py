"""Reading the pipeline's vectors back and training on them (no Beam import).

    from downstream import ElmoOutput, ElmoDataset, ElmoIterableDataset, collate, to_arrow_table, to_hf_dataset
    from downstream.combine import make_combiner        # layer<K> | trainable | frozen | learned

readers.py: manifest-driven readers over Parquet / HDF5 outputs (local or fsspec URLs), torch datasets,
collate, pyarrow / Hugging Face loaders; mapped.py: memory-mapped Arrow reader. combine.py: layer
combination modules and setting names. labels.py: label files (JSONL, TSV, CoNLL-U). sst2.py: SST-2 files ->
pipeline JSONL input. Behind `elmo-pipeline probe`: splits.py (a split's records and batches), heads.py
(classifiers), probe.py (training per setting), metrics.py (accuracy, macro-F1, majority baseline),
report.py (rows over seeds, table.md, results.json), chart.py (chart.png).
"""
from downstream.readers import (ElmoDataset, ElmoIterableDataset, ElmoOutput, collate, lookup_label, to_arrow_table,
                                to_hf_dataset)

__all__ = ["ElmoDataset", "ElmoIterableDataset", "ElmoOutput", "collate", "lookup_label", "to_arrow_table",
           "to_hf_dataset"]
