"""Parquet writer settings (formats.parquet.writer_options) and the benchmark that chose them."""
import pyarrow as pa

from benchmarks.parquet_settings import measure, shard, variants
from formats.parquet import layer_columns, shard_schema, vector_leaves, writer_options


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


def test_every_benchmarked_setting_reads_back_equal():
    table = shard(120)
    assert table.schema.field("layer_1").type == pa.list_(pa.list_(pa.float32(), 1024))
    sizes = {name: measure(table, options, rows=64, repeats=1)[1] for name, options in variants(table.schema).items()}
    assert sizes["vectors zstd (--vector-compression zstd)"] < sizes["pipeline's settings (vectors uncompressed)"]
