"""HDF5 shards, AllenNLP's `elmo` layout: one float dataset per sentence, named by its id.

Dataset names escape '%' as '%25' and '/' as '%2F' ('/' would make groups). Shape (layers, T, 2P) with
layer 0 duplicated as AllenNLP does, or (T, 2P) for --layers top / average. No Beam import.
"""
from __future__ import annotations


def hdf5_key(sentence_id: str) -> str:
    """HDF5 dataset name of a sentence id."""
    return sentence_id.replace("%", "%25").replace("/", "%2F")


def hdf5_unkey(key: str) -> str:
    """Sentence id of an HDF5 dataset name (inverse of hdf5_key)."""
    return key.replace("%2F", "/").replace("%25", "%")


def hdf5_layout(selection: list[int] | str, n_layers: int) -> str:
    """The manifest's hdf5_layout: '(T, D)' for top/average, else '(layers, T, D)'."""
    if selection == "average" or selection == [n_layers - 1]:
        return "(T, D)"
    return "(layers, T, D)"


def hdf5_bytes(sentences) -> bytes:
    """The HDF5 file of (sentence id, array) pairs, built in memory (h5py's core driver, no temporary file)."""
    import h5py
    with h5py.File(f"in-memory-{id(sentences)}.hdf5", "w", driver="core", backing_store=False) as f:
        for sid, arr in sentences:
            f.create_dataset(hdf5_key(sid), data=arr)
        f.flush()
        return f.id.get_file_image()
