"""Parquet page headers read from the file (formats.parquet_pages) against files pyarrow writes: every page
of a chunk walked, the sizes adding up to the footer's, whatever the codec, page version or encoding."""
import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elmo_pipeline.formats.parquet_pages import chunk_span, column_pages, open_checked

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
    md = open_checked(f).metadata           # what pyarrow writes passes the footer check
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


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


@pytest.mark.parametrize("field", [bytes([0x19, 0xF7]) + _varint(1 << 62),          # list<double> of 2^62
                                   bytes([0x1B]) + _varint(1 << 62) + bytes([0x11]),  # map<bool, bool> of 2^62
                                   bytes([0x18]) + _varint(1 << 40)])                 # a binary of 1 TiB
def test_a_header_declaring_more_than_its_chunk_holds_is_an_error_at_once(field):
    """An unknown field of a page header (passed over unread) declaring more elements or bytes than the column chunk
    has left: a ValueError at once, never a walk of 2^62 elements that reads nothing (a hang)."""
    header = field + bytes(200)
    with pytest.raises(ValueError, match="bad Parquet page header"):
        list(column_pages(io.BytesIO(header), 0, len(header)))


def _required_with_histograms(tmp_path) -> str:
    """A Parquet file whose column `text` is made REQUIRED in the footer's schema after pyarrow wrote it OPTIONAL:
    its chunk keeps a definition level histogram of 2 values where its (now 0) levels take 1."""
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": pa.array(["A line here .", None, "Another one ."])}), buf)
    data = buf.getvalue()
    assert data.count(b"\x25\x02\x18\x04text") == 1           # SchemaElement: repetition_type OPTIONAL, name
    path = tmp_path / "bad.parquet"
    path.write_bytes(data.replace(b"\x25\x02\x18\x04text", b"\x25\x00\x18\x04text"))
    return str(path)


def _int64_with_byte_counts(tmp_path) -> str:
    """A binary column `id` made INT64 in the footer's schema: its chunk keeps the byte count of its byte arrays."""
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": pa.array([b"a", b"bb", None], pa.binary())}), buf)
    data = buf.getvalue()
    assert data.count(b"\x15\x0c\x25\x02\x18\x02id") == 1       # SchemaElement: type BYTE_ARRAY, ..., name
    path = tmp_path / "u64.parquet"
    path.write_bytes(data.replace(b"\x15\x0c\x25\x02\x18\x02id", b"\x15\x04\x25\x02\x18\x02id"))
    return str(path)


def _encrypted_columns(tmp_path) -> str:
    """A file pyarrow writes with a column encrypted and its footer in the clear (plaintext-footer mode)."""
    import base64
    from datetime import timedelta

    import pyarrow.parquet.encryption as pe

    class Kms(pe.KmsClient):
        def __init__(self, config):
            super().__init__()

        def wrap_key(self, key, master):
            return base64.b64encode(key)

        def unwrap_key(self, wrapped, master):
            return base64.b64decode(wrapped)
    config = pe.EncryptionConfiguration(footer_key="kf", column_keys={"kc": ["text"]}, plaintext_footer=True,
                                        double_wrapping=False, cache_lifetime=timedelta(minutes=1))
    props = pe.CryptoFactory(Kms).file_encryption_properties(pe.KmsConnectionConfig(), config)
    t = pa.table({"text": ["A line here .", "Another one ."], "n": [1, 2]})
    path = str(tmp_path / "enc.parquet")
    with pq.ParquetWriter(path, t.schema, encryption_properties=props) as w:
        w.write_table(t)
    return path


@pytest.mark.parametrize("make,says", [(_int64_with_byte_counts, "counts byte-array bytes"),
                                       (_encrypted_columns, "encrypted")])
def test_other_footers_pyarrow_aborts_on_are_refused(make, says, tmp_path):
    """A byte count of byte arrays on an INT64 column, encrypted columns (no keys): pyarrow (25) aborts the process
    reading their chunk metadata; open_checked refuses them first."""
    with pytest.raises(ValueError, match=says):
        open_checked(open(make(tmp_path), "rb"))


def test_a_footer_whose_level_histograms_do_not_fit_their_columns_is_refused(tmp_path):
    """pyarrow aborts the whole process (std::terminate) reading such a chunk's metadata; open_checked refuses the
    file first, and a pipeline input holding it is one unreadable-file dead letter."""
    from elmo_pipeline.transforms.read import read_documents
    path = _required_with_histograms(tmp_path)
    with pytest.raises(ValueError, match="level histograms"):
        open_checked(open(path, "rb"))
    [letter] = list(read_documents(path, "parquet", "bad.parquet"))
    assert letter.reason.startswith("unreadable file") and "level histograms" in letter.reason


@pytest.mark.slow       # a process of its own: pyarrow's abort would end this one
def test_pyarrow_itself_aborts_on_such_a_footer(tmp_path):
    """Why open_checked reads the footer first: the file above ends a process reading its chunk metadata with
    SIGABRT (pyarrow 25), no Python exception to catch."""
    import subprocess
    import sys
    path = _required_with_histograms(tmp_path)
    p = subprocess.run([sys.executable, "-c", f"import pyarrow.parquet as pq; pq.ParquetFile({path!r}).metadata"
                        ".row_group(0).column(0)"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "histogram" in p.stderr
