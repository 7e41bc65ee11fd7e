"""Parquet writer settings for the vector columns, measured: encoder CPU per token and file size.

One shard of the default output (sentence layout; layer 0 at 512 floats, layers 1 and 2 at 1,024; fp32) built by
the pipeline's own functions (formats/parquet.py), written in memory with the pipeline's writer settings
(`writer_options`) and with one setting changed at a time: page size, write batch size, data page version,
statistics, BYTE_STREAM_SPLIT and compression of the vector columns. Every file is read back by pyarrow and
DuckDB and must equal the table. The vectors are random normal floats: the sizes of compressed variants are
an upper bound (real vectors compress somewhat better); the CPU of uncompressed variants does not depend on
the values.

Prints a table; writes benchmarks/results/parquet_settings.json naming the CPU.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import resource
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from benchmarks.common import RESULTS, machine
from formats.parquet import ShardColumns, build_table, layer_columns, vector_leaves, writer_options


def shard(tokens: int, seed: int = 0) -> pa.Table:
    """A sentence-layout shard of about `tokens` tokens in 28-token sentences, default layers, random vectors."""
    rng = np.random.default_rng(seed)
    lengths = np.full(max(1, tokens // 28), 28, np.int32)
    n = int(lengths.sum())
    cols = layer_columns([0, 1, 2], 1024, duplicate_layer0=False)
    c = ShardColumns(ids=[f"d{i // 10}#{i % 10}" for i in range(len(lengths))],
                     doc_ids=[f"d{i // 10}" for i in range(len(lengths))],
                     indices=[i % 10 for i in range(len(lengths))], lengths=lengths,
                     tokens=[f"w{i % 5000}" for i in range(n)],
                     offsets=np.stack([np.arange(n) * 5, np.arange(n) * 5 + 4], 1).astype(np.int32),
                     layers=[rng.standard_normal((n, d), dtype=np.float32) for _, d in cols])
    return build_table(c, "sentence", cols)


def variants(schema: pa.Schema) -> dict[str, dict]:
    """name -> pq.ParquetWriter keyword arguments: the pipeline's, then one change each."""
    base = writer_options(schema)
    vec = vector_leaves(schema)
    zstd = {**base["compression"], **{leaf: "zstd" for leaf in vec}}
    return {
        "pipeline's settings (vectors uncompressed)": base,
        "data_page_size 8 MiB (default 1 MiB)": {**base, "data_page_size": 8 << 20},
        "write_batch_size 65536 (default 1024)": {**base, "write_batch_size": 65536},
        "data_page_version 2.0": {**base, "data_page_version": "2.0"},
        "no statistics at all": {**base, "write_statistics": False},
        "BYTE_STREAM_SPLIT on the vectors": {**base, "use_byte_stream_split": vec},
        "vectors zstd (--vector-compression zstd)": {**base, "compression": zstd},
        "vectors BYTE_STREAM_SPLIT + zstd": {**base, "compression": zstd, "use_byte_stream_split": vec},
    }


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(table: pa.Table, options: dict, rows: int, repeats: int) -> tuple[float, int]:
    """(best CPU seconds of `repeats` encodes, file bytes); checks the read-back."""
    best, data = float("inf"), b""
    for _ in range(repeats):
        sink = io.BytesIO()
        t = cpu_s()
        with pq.ParquetWriter(sink, table.schema, **options) as w:
            w.write_table(table, row_group_size=rows)
        best = min(best, cpu_s() - t)
        data = sink.getvalue()
    back = pq.read_table(io.BytesIO(data))
    if not back.equals(table):
        raise AssertionError("pyarrow read back a different table")
    try:
        import duckdb
    except ImportError:
        return best, len(data)
    fd, path = tempfile.mkstemp(suffix=".parquet")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    try:
        got = duckdb.connect().sql(f"SELECT layer_1 FROM '{path}'").to_arrow_table()
    finally:
        os.remove(path)
    flat = lambda col: pc.list_flatten(pc.list_flatten(col)).to_numpy()
    if not np.array_equal(flat(got.column("layer_1")), flat(table.column("layer_1"))):
        raise AssertionError("DuckDB read back different vectors")
    return best, len(data)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=40000, help="tokens in the shard (default 40000)")
    ap.add_argument("--repeats", type=int, default=3, help="encodes per setting, best kept (default 3)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "parquet_settings.json"))
    a = ap.parse_args()
    table = shard(a.tokens)
    n = sum(len(x) for x in table.column("tokens").to_pylist())
    rows = max(1, int((64 << 20) // (table.nbytes / table.num_rows)))   # the pipeline's 64 MiB row groups
    print(f"{machine()}; {n} tokens, {table.num_rows} sentences, 2,560 floats per token", flush=True)
    results = {}
    for name, options in variants(table.schema).items():
        cpu, size = measure(table, options, rows, a.repeats)
        results[name] = {"cpu_us_per_token": cpu / n * 1e6, "bytes_per_token": size / n}
        print(f"  {name:45s} {cpu / n * 1e6:7.2f} us CPU/token  {size / n:8.0f} bytes/token", flush=True)
    with open(a.out, "w") as f:
        json.dump({"machine": machine(), "tokens": n, "repeats": a.repeats, "results": results}, f, indent=1)
    print(f"wrote {os.path.relpath(a.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
