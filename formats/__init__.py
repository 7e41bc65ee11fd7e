"""The pipeline's output format: one module per concern, used by the writer, Finalize and downstream/.

    formats.layout   the folder: file names, staging, commit records, dead letters, the manifest
    formats.parquet  Parquet schema by layout, table building, writer settings
    formats.hdf5     HDF5 dataset names (both ways) and layout
No Beam import; formats.layout imports nothing but the standard library.
"""
