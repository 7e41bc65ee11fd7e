"""elmo-pipeline: ELMo contextual word vectors for large corpora with Apache Beam.

Beam ships this file to remote workers with --setup_file. Install torch (CPU or CUDA build)
before this package; see constraints.txt for the pinned, tested versions.
"""
from setuptools import find_packages, setup

FOLDERS = ["fsio", "formats", "output", "model", "tokenization", "transforms", "training", "pipeline", "downstream"]

setup(
    name="elmo-pipeline",
    version="0.1.0",
    description="Batch ELMo feature extraction: an exact PyTorch biLM in an Apache Beam pipeline",
    python_requires=">=3.10",
    # one import name: the top-level folders become elmo_pipeline.model, elmo_pipeline.pipeline, ...
    packages=["elmo_pipeline"] + [f"elmo_pipeline.{p}"
                                  for p in find_packages(include=[p for f in FOLDERS for p in (f, f + ".*")])],
    package_dir={"elmo_pipeline": "elmo_pipeline", **{f"elmo_pipeline.{f}": f for f in FOLDERS}},
    package_data={"elmo_pipeline.model": ["pretrained/*/*.json", "pretrained/*/*.hdf5", "pretrained/*/*.txt",
                                          "pretrained/*/*.md", "pretrained/*/*.csv", "pretrained/*/*.png"]},
    include_package_data=True,
    install_requires=[
        "apache-beam>=2.77,<3",   # never the [torch]/[ml-cpu] extras: they pull an old Beam
        "torch>=2.2",
        "numpy>=1.24,<2.5",
        "pyarrow>=17,<26",
        "h5py>=3.10",
        "fsspec[http]>=2024.6",    # https:// model files and inputs (published models by name) need aiohttp
        "requests>=2.31",          # ... and fsspec's HTTPFileSystem imports requests too
        "tqdm>=4.66",
        "sacremoses>=0.1",        # Moses word tokenization (tokenization/tokenizers.py)
        "blingfire>=0.1.8",       # sentence splitting with offsets
        "zstandard>=0.22",        # .zst inputs through fsspec
    ],
    extras_require={
        "s3": ["s3fs>=2024.6", "boto3>=1.34"],
        "dask": ["dask[distributed]>=2024.6"],    # --runner apache_beam.runners.dask.dask_runner.DaskRunner
        # downstream/: Hugging Face datasets loader, PNG charts of the probe (Pillow fallback without matplotlib)
        "downstream": ["datasets>=3", "matplotlib>=3.7"],
        # --iceberg-table: pyiceberg with its SQL catalog (SQLite; Postgres needs a driver too) and pyarrow I/O
        "iceberg": ["pyiceberg[sql-sqlite,pyarrow]>=0.12,<0.13"],
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "duckdb>=1.1", "moto[server]>=5", "s3fs>=2024.6",
                 "boto3>=1.34",
                 "dask[distributed]>=2024.6",
                 "datasets>=3", "matplotlib>=3.7",
                 "pyiceberg[sql-sqlite,pyarrow]>=0.12,<0.13",
                 "prometheus_client>=0.20"],   # the reference parser of metrics.prom (tests/test_metrics.py)
    },
    entry_points={"console_scripts": ["elmo-pipeline=elmo_pipeline.pipeline.cli:console"]},
)
