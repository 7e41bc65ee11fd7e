"""Parquet writer settings (formats.parquet.writer_options; chosen by docs/decisions/parquet-settings.md)."""
import io

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elmo_pipeline.formats.parquet import ShardColumns, build_table, layer_columns, shard_schema, vector_leaves, writer_options


def test_writer_options_vectors_uncompressed_text_zstd_statistics_on_ids():
    schema = shard_schema("sentence", layer_columns([0, 2], 16, duplicate_layer0=False), "float32")
    o = writer_options(schema)
    assert vector_leaves(schema) == ["layer_0.list.element.list.element", "layer_2.list.element.list.element"]
    assert {k for k, v in o["compression"].items() if v == "none"} == set(vector_leaves(schema))
    assert o["compression"]["tokens.list.element"] == o["compression"]["id"] == "zstd"
    assert o["write_statistics"] == ["id", "doc_id", "sentence_index"] and o["use_dictionary"] == ["doc_id"]
    token = shard_schema("token", layer_columns("average", 16, duplicate_layer0=False), "float16")
    assert writer_options(token, "zstd")["compression"]["average.list.element"] == "zstd"
    assert "token" in writer_options(token)["write_statistics"]


def shard(sentences: int, length: int = 28) -> pa.Table:
    """A sentence-layout shard of the default layers (layer 0 512 wide, layers 1-2 1,024) with random vectors."""
    rng = np.random.default_rng(0)
    lengths = np.full(sentences, length, np.int32)
    n = int(lengths.sum())
    cols = layer_columns([0, 1, 2], 1024, duplicate_layer0=False)
    c = ShardColumns(ids=[f"d{i // 10}#{i % 10}" for i in range(sentences)],
                     doc_ids=[f"d{i // 10}" for i in range(sentences)], indices=[i % 10 for i in range(sentences)],
                     lengths=lengths, tokens=[f"w{i % 500}" for i in range(n)],
                     offsets=np.stack([np.arange(n) * 5, np.arange(n) * 5 + 4], 1).astype(np.int32),
                     layers=[rng.standard_normal((n, d), dtype=np.float32) for _, d in cols])
    return build_table(c, "sentence", cols)


def encoded(table: pa.Table, options: dict, path) -> bytes:
    with pq.ParquetWriter(path, table.schema, **options) as w:
        w.write_table(table, row_group_size=2)
    return path.read_bytes()


def test_default_and_zstd_vectors_read_back_equal(tmp_path):
    """Both vector settings read back equal by pyarrow and DuckDB; zstd vectors make a smaller file."""
    table = shard(4)
    assert table.schema.field("layer_1").type == pa.list_(pa.list_(pa.float32(), 1024))
    sizes = {}
    for name in ("none", "zstd"):
        path = tmp_path / f"{name}.parquet"
        sizes[name] = len(encoded(table, writer_options(table.schema, name), path))
        assert pq.read_table(io.BytesIO(path.read_bytes())).equals(table)
        got = duckdb.connect().sql(f"SELECT layer_1 FROM '{path}'").to_arrow_table().column("layer_1")
        flat = lambda col: pc.list_flatten(pc.list_flatten(col)).to_numpy()
        assert np.array_equal(flat(got), flat(table.column("layer_1")))
    assert sizes["zstd"] < sizes["none"]
