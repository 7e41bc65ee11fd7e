"""Reading the pipeline's vectors back and training on them (no Beam import).

    from downstream import ElmoOutput, ElmoDataset, ElmoIterableDataset, collate, to_arrow_table, to_hf_dataset
    from downstream.combine import make_combiner        # layer<K> | trainable | frozen | learned

readers.py: manifest-driven readers over Parquet / HDF5 outputs (local or fsspec URLs), torch datasets,
collate, pyarrow / Hugging Face loaders. combine.py: layer combination modules. probe.py: the models,
training and reports behind `elmo-pipeline probe`. labels.py: label files (JSONL, TSV, CoNLL-U).
sst2.py: SST-2 files -> pipeline JSONL input.
"""
from downstream.readers import (ElmoDataset, ElmoIterableDataset, ElmoOutput, collate, lookup_label, to_arrow_table,
                                to_hf_dataset)

__all__ = ["ElmoDataset", "ElmoIterableDataset", "ElmoOutput", "collate", "lookup_label", "to_arrow_table",
           "to_hf_dataset"]
