"""The pipeline's own flags, as a Beam PipelineOptions subclass (Beam's standard flags go alongside)."""
from __future__ import annotations

import argparse
import os

from apache_beam.options.pipeline_options import PipelineOptions

from elmo_pipeline.formats.layout import FORMATS, PARQUET_LAYOUTS, STORAGE_DTYPES
from elmo_pipeline.formats.iceberg.upsert import MODES as ICEBERG_MODES
from elmo_pipeline.formats.parquet import VECTOR_COMPRESSIONS
from elmo_pipeline.model.options import COMPUTE_DTYPES, STATE_MODES
from elmo_pipeline.transforms.read import INPUT_FORMATS, MAX_RECORD_BYTES
from elmo_pipeline.transforms.records import MAX_DOCUMENT_TOKENS
from elmo_pipeline.pipeline.read_plan import MAX_SPLIT_BYTES, MIN_SPLIT_BYTES, TARGET_SPLITS
from elmo_pipeline.tokenization import TOKENIZERS


class ElmoOptions(PipelineOptions):
    @classmethod
    def _add_argparse_args(cls, parser):
        """The flags, by concern (their order is --help's)."""
        g = parser.add_argument
        _input_flags(g)
        _output_flags(g)
        _sentence_flags(g)
        _model_flags(g)
        _reuse_flags(g)
        _vector_flags(g)
        _speed_flags(g)
        _table_flags(g)

    def formats(self) -> list[str]:
        fmts = [f.strip() for f in self.format.split(",") if f.strip()]
        bad = [f for f in fmts if f not in FORMATS]
        if not fmts or bad:
            raise ValueError(f"--format takes a comma-separated list of {', '.join(FORMATS)}, got {self.format!r}")
        return fmts


def _input_flags(g) -> None:
    """The inputs and how they are read."""
    g("--input", action="append", default=None,
      help="input file, glob or URL (repeatable); .gz/.bz2/.zst/.xz decompressed by name")
    g("--input-format", choices=INPUT_FORMATS, default="text",
      help="text: one document per line; lines: one sentence per line; jsonl; parquet (default text)")
    g("--text-field", default="text", help="JSONL field / Parquet column holding the text (default text)")
    g("--id-field", default=None, help="JSONL field / Parquet column holding the document id "
      "(default: <file>:<line or row>)")
    g("--id-root", default=None, metavar="PATH",
      help="default ids name each file by its path relative to this folder (path or URL; an input outside it is "
      "an error). Default: relative to the folder common to the inputs, or with --iceberg-table the file's full "
      "path or URL, so that partitions' ids never collide (docs/warehouses.md)")
    g("--max-record-bytes", type=int, default=MAX_RECORD_BYTES,
      help="a longer input record (a line of a text/JSONL file as stored, without its newline, or a Parquet "
      f"text cell in UTF-8) is a dead letter 'too long', read in blocks and never held whole (default "
      f"{MAX_RECORD_BYTES} = {MAX_RECORD_BYTES >> 20} MiB): bounds the memory a record can take")
    g("--split-bytes", type=int, default=0,
      help="read uncompressed text/JSONL files in byte ranges of about this many bytes (cut at line starts) and "
      "Parquet files in runs of row groups of about this many bytes, so that one big file is read by many "
      f"workers (default 0: the corpus's bytes / {TARGET_SPLITS}, within {MIN_SPLIT_BYTES >> 10} KiB and "
      f"{MAX_SPLIT_BYTES >> 20} MiB, where the work is spread: several workers or a cluster; -1: read every file "
      "whole; docs/scaling-out.md)")
    g("--max-document-tokens", type=int, default=MAX_DOCUMENT_TOKENS,
      help="a document with more tokens in all its sentences is one dead letter 'too long' (its sentence #0; "
      f"default {MAX_DOCUMENT_TOKENS})")


def _output_flags(g) -> None:
    """The output and its formats."""
    g("--output", default=None, help="output folder (path or URL)")
    g("--overwrite", action="store_true", help="replace a finished run in --output (also one of this same command, which is otherwise left as "
      "it is: 'already complete')")
    g("--format", default="parquet,hdf5",
      help="comma-separated: parquet, hdf5 (default both), arrow (Arrow IPC, a row per token, memory-mapped by "
      "downstream.mapped for training: docs/downstream.md)")
    g("--parquet-layout", choices=PARQUET_LAYOUTS, default="sentence",
      help="sentence: one row per sentence (default); token: one row per token (BigQuery)")


def _sentence_flags(g) -> None:
    """Sentences, windows and batches."""
    g("--tokenizer", choices=TOKENIZERS, default="raw",
      help="raw: sentence split + the tokenization of the model's training text (default: wikitext for the "
      "shipped model and custom files, moses for the published ones); wikitext: Moses tokens with hyphens split "
      "(High @-@ Speed); moses: Moses tokens, hyphenated words whole; whitespace: pre-tokenized, no sentence split")
    g("--max-sentence-tokens", type=int, default=100_000,
      help="hard cap: longer sentences go to the dead letters (default 100000; was 1000)")
    g("--window-tokens", type=int, default=1000,
      help="sentences longer than this are embedded as overlapping windows of this many tokens, stitched "
      "(default 1000; capped at --max-tokens-per-batch - 2)")
    g("--window-overlap", type=int, default=None,
      help="tokens shared by consecutive windows; each position's vectors come from the window where it is "
      "farthest from an edge (default 200, at most --window-tokens / 5)")
    g("--max-tokens-per-batch", type=int, default=4096,
      help="token budget of a batch, <S> </S> included: token slots, or padded slots in stateful mode "
      "(default 4096)")
    g("--sort-buffer", type=int, default=2000,
      help="sentences buffered and length-sorted before batching (default 2000)")


def _model_flags(g) -> None:
    """The model, its device and state."""
    g("--options-file", default=None, help="biLM options.json (path or URL)")
    g("--weight-file", default=None, help="biLM weights.hdf5 (path or URL)")
    g("--vocab-file", default=None, help="vocabulary, for word-encoder models only")
    g("--model", default=None, help="a model by name: the shipped wikitext2-small (default) or a published one "
      "(small, medium, original, original-5.5B; downloaded into the cache on first use, sha256 verified after): "
      "`elmo-pipeline models` lists them")
    g("--device", default="auto", help="auto | cpu | cuda | cuda:N (a missing GPU is an error)")
    g("--state", choices=STATE_MODES, default="stateless",
      help="LSTM state mode (default stateless; stateful needs one worker and keeps input order)")
    g("--batch-invariant", action=argparse.BooleanOptionalAction, default=False,
      help="bit-identical vectors for a sentence whatever the batch budget, workers, torch threads or resume, so "
      "one-shard files hash the same (every GEMM on row counts checked to keep a row's bits; docs/exactness.md); "
      "--state stateless or warm; "
      "costs about 1-6%% of tokens/s (benchmarks/README.md). Default off: equal to float32 round-off only")


def _reuse_flags(g) -> None:
    """What is embedded once or taken from earlier outputs."""
    g("--dedupe", choices=("auto", "on", "off"), default="auto",
      help="embed the sentences of equal tokens once and write every occurrence with those vectors (a "
      "GroupByKey over every sentence by its key). auto (default): on where exact, with --batch-invariant "
      "and --state stateless or warm; on: also without it (copies equal to float32 round-off); not stateful")
    g("--reuse", action="append", default=None, metavar="OUTPUT",
      help="an earlier finished output (path or URL; repeatable) of the same model and vector settings: a "
      "sentence whose key its key index holds is written with its stored vectors instead of being embedded (a "
      "join by key on the runner; --state stateless or warm; another model's output is refused: docs/reuse.md)")
    g("--reuse-table", action="store_true",
      help="with --iceberg-table: also reuse the vectors of the outputs registered in the table's current "
      "snapshot, as --reuse does (those of another model or vector settings are left out, logged; docs/reuse.md)")
    g("--reuse-across-kernels", action="store_true",
      help="reuse a source (or, with --iceberg-mode upsert, keep the table's unchanged rows) whose record names "
      "another kernel path (LSTM loop, CPU kernel class, torch/oneDNN versions, math modes: "
      "docs/exactness.md#kernel-path) instead of refusing it; its vectors differ from "
      "this run's in the last bits (the tolerance: docs/reuse.md#kernel-paths); recorded in the manifest")


def _vector_flags(g) -> None:
    """The vectors stored and the shards' layout."""
    g("--layers", default="all", help="all | top | average | comma-separated indices (default all)")
    g("--dtype", choices=STORAGE_DTYPES, default="float32", help="storage precision (default float32)")
    g("--compute-dtype", choices=COMPUTE_DTYPES, default="float32",
      help="precision the biLM runs in: float32 (default, exact), bfloat16 or float16 (within 1e-2 relative "
      "error per layer; faster only where the hardware runs them natively: GPUs, and for bfloat16 CPUs with "
      "AVX512_BF16 or AMX; `elmo-pipeline doctor` tells; docs/exactness.md)")
    g("--duplicate-layer0", action="store_true",
      help="Parquet: store layer 0 as [x, x] (2P wide) as AllenNLP does, instead of x once")
    g("--vector-compression", choices=VECTOR_COMPRESSIONS, default="none",
      help="Parquet compression of the vector columns (text and ids are always zstd): none (default; fastest "
      "to write and read), zstd (smaller files, more encoding CPU: see docs/pipeline.md), lz4, snappy")
    g("--row-group-bytes", type=int, default=64 << 20, help="Parquet row-group size in bytes (default 64 MiB)")
    g("--shard-sentences", type=int, default=20000, help="max sentences per output shard (default 20000)")
    g("--shard-bytes", type=int, default=64 << 20,
      help="a shard also ends when its buffered vectors reach this many bytes (default 64 MiB): bounds memory")


def _speed_flags(g) -> None:
    """Speed (not in the run key)."""
    g("--torch-threads", type=int, default=0,
      help="torch intra-op threads per worker process (default: cores / local worker processes)")
    g("--embed-threads", type=int, default=0,
      help="batches a worker runs through the biLM at once, each on its own thread (same vectors, same order; "
      "default 0 = auto: 2 where a local worker has a core per torch thread to spare, i.e. --torch-threads 1 on "
      "2+ cores per worker, no tokenizer child processes, and the state is stateless or warm; else 1)")
    g("--tokenizer-process", choices=("auto", "on", "off"), default="auto",
      help="tokenize in a child process of each worker, beside its biLM (auto: on for the raw tokenizers on "
      "local runners with 2+ cores; not on DaskRunner, which drops what a step emits at a bundle's end)")
    g("--progress", choices=("auto", "on", "off"), default="auto",
      help="progress bar: percent and ETA by input bytes, tokens/s (auto: on for local runs with a terminal)")


def _table_flags(g) -> None:
    """Tables and storage."""
    g("--lease-stale-seconds", type=float, default=60.0,
      help="a run holds --output by a lease refreshed every quarter of this; another run takes it over only "
      "when its heartbeat is older than this (or its process, on the same host, is gone). Default 60")
    g("--iceberg-table", default=None, metavar="NS.TABLE",
      help="at Finalize, add the run's Parquet shards (as they are, no copy) to this Apache Iceberg table in one "
      "snapshot, exactly once; created from the shard schema when absent (pip install 'elmo-pipeline[iceberg]'; "
      "docs/warehouses.md)")
    g("--iceberg-catalog", default=None, metavar="URI",
      help="the table's catalog (pyiceberg): sqlite:///path.db or postgresql+psycopg2://... (SQL catalog), "
      "http(s)://... (REST catalog)")
    g("--iceberg-warehouse", default=None, metavar="URL",
      help="where a new table's metadata is written (default: for sqlite:///, the folder of the database file); "
      "the data files stay in --output")
    g("--iceberg-mode", choices=ICEBERG_MODES, default="append",
      help="append (default): the shards are added, ids new to the table. upsert: the table mirrors the corpus, "
      "only new or changed documents (by --id-field and content hash) are embedded and replace their rows")
    g("--delete-missing", action="store_true",
      help="with --iceberg-mode upsert: also remove from the table the documents no longer in the input")
    g("--s3-max-attempts", type=int, default=10,
      help="attempts per S3 request, first one included (botocore 'standard' retries with exponential "
      "backoff on 500/503/throttling/connection errors; default 10)")


class JobOptions(PipelineOptions):
    """How the job reports, not what it computes: outside ElmoOptions, so neither in the run key nor in the
    manifest's options."""
    @classmethod
    def _add_argparse_args(cls, parser):
        g = parser.add_argument
        g("--dry-run", action="store_true",
          help="print the plan (inputs, documents and tokens estimated from a sample, output bytes per format, "
          "layer and dtype, shards, time at this machine's measured biLM rate) and exit 0; --output is not "
          "touched (also: elmo-pipeline plan ...)")
        g("--metrics-file", default=None, metavar="PATH",
          help="also write the run's metrics (Prometheus text format, as <output>/metrics.prom) to this local file "
          "(a URL is refused), atomically: e.g. into node_exporter's textfile collector folder. Written on failure "
          "too, with the exit status")
        g("--verbose", action="store_true", help="on failure, the traceback too (default: one line `error: ...`)")


def default_torch_threads(num_workers: int) -> int:
    """Cores / local worker processes (at least 1): more threads than cores make LSTMs crawl."""
    return max(1, (os.cpu_count() or 1) // max(1, num_workers))
