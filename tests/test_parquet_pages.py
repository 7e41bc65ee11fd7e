"""Parquet page headers read from the file (formats.parquet_pages) against files pyarrow writes: every page
of a chunk walked, the sizes adding up to the footer's, whatever the codec, page version or encoding."""
import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elmo_pipeline.formats.parquet_pages import chunk_span, column_pages

CODECS = ["none", "snappy", "gzip", "zstd", "brotli", "lz4"]


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.none() | st.text(max_size=300), min_size=1, max_size=300),
       codec=st.sampled_from(CODECS), dictionary=st.booleans(), version=st.sampled_from(["1.0", "2.0"]),
       page_size=st.integers(1, 4096), batch=st.integers(1, 64), statistics=st.booleans(),
       page_index=st.booleans(), checksum=st.booleans(), group=st.integers(1, 300))
def test_page_headers_add_up_to_the_chunk(values, codec, dictionary, version, page_size, batch, statistics,
                                          page_index, checksum, group):
    buf = io.BytesIO()
    pq.write_table(pa.table({"n": list(range(len(values))), "text": pa.array(values, pa.string())}), buf,
                   compression=codec, use_dictionary=dictionary, data_page_version=version, data_page_size=page_size,
                   write_batch_size=batch, write_statistics=statistics, write_page_index=page_index,
                   write_page_checksum=checksum, row_group_size=group)
    f = io.BytesIO(buf.getvalue())
    md = pq.ParquetFile(f).metadata
    for g in range(md.num_row_groups):
        for c in range(md.num_columns):
            chunk = md.row_group(g).column(c)
            start, length = chunk_span(chunk)
            pages = list(column_pages(f, start, length))
            assert sum(p.header + p.compressed for p in pages) == length == chunk.total_compressed_size
            assert sum(p.header + p.uncompressed for p in pages) == chunk.total_uncompressed_size
            assert [p.kind == 2 for p in pages] == [chunk.has_dictionary_page] + [False] * (len(pages) - 1)
            assert {p.kind for p in pages[chunk.has_dictionary_page:]} == {0 if version == "1.0" else 3}
            if c == 1 and not dictionary and codec == "none":     # plain values: 4 length bytes + the UTF-8
                rows = values[sum(md.row_group(h).num_rows for h in range(g)):][:md.row_group(g).num_rows]
                longest = max((len(v.encode()) for v in rows if v is not None), default=0)
                assert max(p.uncompressed for p in pages) >= longest + 4 * (longest > 0)


def test_a_long_statistics_value_is_passed_over_and_a_cut_header_is_an_error():
    """A page header whose statistics hold a value longer than one 4 KiB read is walked past it; a chunk cut
    off in a header is a ValueError/EOFError (the reader's "unreadable file"), never a wrong size."""
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": ["b" * 4090, "a"]}), buf, use_dictionary=False, compression="zstd")
    data = buf.getvalue()
    chunk = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(0).column(0)
    [page] = column_pages(io.BytesIO(data), *chunk_span(chunk))
    assert page.uncompressed >= 4094 and page.header > 4096
    start, _ = chunk_span(chunk)
    with pytest.raises((ValueError, EOFError)):
        list(column_pages(io.BytesIO(data[:start + 10]), start, 100))
