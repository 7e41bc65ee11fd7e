"""Local paths and fsspec URLs (s3://, gs://, memory://, ...): the project's one way to reach storage.

Storage options travel in one shape everywhere: {protocol: {fsspec option: value}}, e.g.
{"s3": {"endpoint_url": "http://127.0.0.1:5000", "key": "testing", "secret": "testing"}}, so one
mapping serves inputs, outputs and model files on different stores. Public APIs that take the flat
options of one URL's filesystem convert them once with keyed().
"""
from __future__ import annotations

import hashlib
import os
import posixpath
import re
import socket
import uuid
from contextlib import contextmanager

import fsspec
from fsspec.registry import known_implementations

# protocol -> the command that installs its fsspec implementation (others: the package fsspec's registry names)
INSTALL = {"s3": "pip install 'elmo-pipeline[s3]'", "s3a": "pip install 'elmo-pipeline[s3]'",
           "http": "pip install 'fsspec[http]' requests", "https": "pip install 'fsspec[http]' requests"}
_QUERY = re.compile(r"\?[^/?#=&]+=")      # a URL's query string (?name=...): not fsspec's ? wildcard


class StorageUnavailable(ImportError):
    """A URL whose protocol's fsspec implementation (or a package it imports) is not installed."""


def protocol(url: str) -> str:
    """'s3' for 's3://b/k', 'file' for a local path or file:// URL."""
    return str(url).split("://", 1)[0] if "://" in str(url) else "file"


def check_protocol(url: str) -> None:
    """StorageUnavailable (an ImportError) naming what to install when `url`'s protocol (each of a chained URL's)
    has no importable fsspec implementation; an unknown protocol is left to fsspec's own error."""
    for proto in protocol(url).split("::"):
        try:
            fsspec.get_filesystem_class(proto)
        except ImportError as e:
            known = known_implementations.get(proto, {}).get("class", "")
            package = (known.split(".", 1)[0] if known and not known.startswith("fsspec.")
                       else getattr(e.__cause__, "name", None) or proto)     # fsspec's own: what it imports
            install = INSTALL.get(proto, f"pip install {package}")
            raise StorageUnavailable(f"{proto}:// URLs need {package}, which cannot be imported "
                                     f"({e.__cause__ or e}): {install}") from None
        except ValueError:
            pass


def options_for(url: str, storage_options: dict | None) -> dict:
    """The flat fsspec options for `url`'s protocol out of {protocol: {...}} (a copy)."""
    return dict((storage_options or {}).get(protocol(url), {}))


def keyed(url: str, flat_options: dict | None) -> dict:
    """{protocol of url: flat_options}: the project's shape for a public API's flat options."""
    return {protocol(url): dict(flat_options)} if flat_options else {}


def url_fs(url: str, storage_options: dict | None = None):
    """(fsspec filesystem, path within it) for a local path or URL."""
    check_protocol(url)
    return fsspec.core.url_to_fs(url, **options_for(url, storage_options))


def open_file(url: str, mode: str = "rb", storage_options: dict | None = None, **kwargs):
    """fsspec.open(url, mode) with the options for its protocol (kwargs: compression, encoding, ...)."""
    check_protocol(url)
    return fsspec.open(url, mode, **kwargs, **options_for(url, storage_options))


def expand(patterns: list[str], storage_options: dict | None = None) -> list[str]:
    """Sorted files matching paths, URLs or globs, each file once however it is spelled (x.txt, ./x.txt,
    dir//x.txt; /abs/x.txt and file:///abs/x.txt; an object store's key as it is: normalise); a pattern matching no file is an error. Remote matches keep
    their scheme (s3://bucket/key); local ones are plain paths. A URL with a query string (a presigned URL:
    ?X-Amz-Signature=...) is one file, never a pattern. Folders a glob matches are passed over; a local match that
    is neither a folder nor a regular file is a FileNotFoundError naming it, but for an editor's lock link (.#name:
    a link to nothing), passed over."""
    found: dict[str, str] = {}          # the file (a path, or a URL) -> its spelling first in sort order
    for pattern in patterns:
        for url in _matches(pattern, storage_options):
            same = url[len("file://"):] if url.startswith("file://") else url
            found[same] = min(found.get(same, url), url)
    return sorted(found.values())


# protocols whose paths are resolved (by the OS, or by the HTTP client per RFC 3986): the same file however spelled.
# Any other URL's path is an object's key, a name taken as it is: s3://b/a//x.txt, s3://b/a/x.txt and
# s3://b/a/y/../x.txt are three objects.
RESOLVED_PATHS = ("file", "local", "http", "https")


def normalise(url: str) -> str:
    """A path or URL with its path part normalised (no empty, . or .. segments), its query string as it is; an
    object store's key (a URL of a protocol not in RESOLVED_PATHS) as it is."""
    if "://" not in url:
        return os.path.normpath(url)
    head, rest = url.split("://", 1)
    query = _QUERY.search(rest)
    rest, query = (rest[:query.start()], rest[query.start():]) if query else (rest, "")
    host, slash, path = rest.partition("/")
    if slash:
        path = posixpath.normpath(re.sub("/+", "/", "/" + path)) if head in RESOLVED_PATHS else slash + path
    return f"{head}://{host}{path}{query}"


def _matches(pattern: str, storage_options: dict | None) -> list[str]:
    """The files a pattern names, normalised (FileNotFoundError when none)."""
    url = normalise(pattern)
    if "://" in url and _QUERY.search(url):
        fs, path = url_fs(url, storage_options)
        found = [url] if _is_file(fs, path) else []
    else:
        check_protocol(url)
        fs, _, paths = fsspec.get_fs_token_paths(url, storage_options=options_for(url, storage_options))
        found = [fs.unstrip_protocol(p) if "://" in url else p for p in paths if _is_file(fs, p)]
        if is_local_fs(fs):         # a FIFO, a device, a socket or a link to nothing: never dropped unsaid
            odd = [p for p in paths if os.path.lexists(p) and not os.path.isdir(p) and not os.path.isfile(p)
                   and not os.path.basename(p).startswith(".#")]     # an editor's lock link (Emacs: .#name)
            if odd:
                raise FileNotFoundError(f"input {pattern!r} matches {odd[0]}, which is no regular file (a FIFO, a "
                                        "device, a socket or a symbolic link to nothing): nothing is read from it; "
                                        "move it away or narrow the pattern")
    if not found:
        raise FileNotFoundError(f"input {pattern!r} matches no file")
    return found


def _is_file(fs, path: str) -> bool:
    """fs.isfile(), except that a store that cannot be reached or that fails raises (isfile() says False: 'matches
    no file'; fsspec's HTTP store says FileNotFoundError for a 5xx too: its cause tells, http_status)."""
    try:
        return fs.info(path).get("type") == "file"
    except FileNotFoundError as e:
        if store_failing(e):
            raise
        return False


def bounded_lines(f, max_chars: int, where: str):
    """The lines of text stream `f` without their line ends (LF or CRLF), each read at most max_chars + 2
    characters at a time: ValueError naming `where` and the line number at a longer one, never read whole."""
    for n, line in enumerate(iter(lambda: f.readline(max_chars + 2), ""), 1):
        line = line.rstrip("\n").rstrip("\r")
        if len(line) > max_chars:
            raise ValueError(f"{where}:{n}: a line over {max_chars} characters")
        yield line


def store_failing(e: FileNotFoundError) -> bool:
    """Whether an fsspec store's FileNotFoundError is the store failing, not the file missing (fsspec's HTTP store
    raises it for both; its cause tells): a 5xx, 408 or 429 answer, or a connection refused, reset or timed out, or
    a host name that does not resolve (aiohttp's ClientConnectionError, socket errors)."""
    def unreachable(c: BaseException) -> bool:
        return isinstance(c, (ConnectionError, TimeoutError, socket.gaierror)) or any(
            k.__name__ == "ClientConnectionError" and k.__module__.startswith("aiohttp") for k in type(c).__mro__)
    return transient_http(http_status(e)) or any(unreachable(c) for c in exception_chain(e)[1:])


def storage_error(e: BaseException) -> bool:
    """Whether `e` is a failure of the storage or the network under a file, never of its content: an OSError, or an
    HTTP client's error (aiohttp's ClientError: a refused, expired or missing URL, a 5xx, a dropped connection;
    known by class, aiohttp being optional)."""
    return isinstance(e, OSError) or any(c.__name__ == "ClientError" and c.__module__.startswith("aiohttp")
                                         for c in type(e).__mro__)


def exception_chain(exc: BaseException | None) -> list[BaseException]:
    """The exception and its causes/contexts, outermost first (no loops)."""
    out, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def http_status(e: BaseException) -> int | None:
    """The HTTP status of the first response error (aiohttp's ClientResponseError) in e's chain of causes, if any."""
    return next((c.status for c in exception_chain(e)
                 if type(c).__name__ == "ClientResponseError" and type(getattr(c, "status", None)) is int), None)


TRANSIENT_HTTP = (408, 429)     # besides a server error (5xx): a request timeout, too many requests


def transient_http(status: int | None) -> bool:
    """Whether an HTTP status says to retry later: a server error (5xx) or one of TRANSIENT_HTTP."""
    return status is not None and (status >= 500 or status in TRANSIENT_HTTP)


def is_local_fs(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,))


def is_local_url(url: str) -> bool:
    return protocol(url) == "file"


def makedirs(fs, path: str) -> None:
    """Create a local folder; nothing on object stores (no folders there, and each call costs requests)."""
    if is_local_fs(fs):
        fs.makedirs(path, exist_ok=True)


def move(fs, src: str, dst: str, replace: bool = True) -> None:
    """A local rename (atomic), or an object store's server-side copy then delete (the copy appears whole).
    replace=False: FileExistsError when something is at `dst`, never replaced: locally a hard link then the
    unlink of `src` (atomic: a file placed there at any moment stays), else a check just before the rename or
    copy."""
    if not replace:
        if is_local_fs(fs):
            try:
                os.link(src, dst, follow_symlinks=False)
            except FileExistsError:
                raise FileExistsError(dst) from None
            except OSError:             # no hard links there (another device, a FUSE store): check, then rename
                pass
            else:
                os.remove(src)
                return
        if fs.lexists(dst) if is_local_fs(fs) else fs.exists(dst):
            raise FileExistsError(dst)
    if is_local_fs(fs):
        fs.mv(src, dst)
    else:
        fs.cp_file(src, dst)
        fs.rm_file(src)


def place(src: str, dst: str, seen: os.stat_result | None) -> None:
    """The local file `src` becomes `dst` only over what was seen at `dst` (os.lstat) before it was written: nothing
    (seen None: move() without replace, atomic), or the very file `seen` (its device, inode, size and mtime, checked
    just before the rename). FileExistsError otherwise: whatever is at `dst` then is left as it is."""
    if seen is None:
        move(fsspec.filesystem("file"), src, dst, replace=False)
        return
    try:
        now = os.lstat(dst)
    except FileNotFoundError:
        raise FileExistsError(dst) from None        # removed since: not the file seen, nor for this call to put back
    if (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns) != (seen.st_dev, seen.st_ino, seen.st_size,
                                                                  seen.st_mtime_ns):
        raise FileExistsError(dst)
    os.replace(src, dst)


TEMP_MARK = ".tmp-"
TEMP_NAME = re.compile(r"\.tmp-[0-9a-f]{32}$")      # what temp_name() appends


NAME_MAX = 255      # bytes in one folder entry's name (Linux, macOS)


def temp_name(path: str) -> str:
    """The one temporary name of a file being written: temp_stem(path) + ".tmp-<uuid hex>" (renamed to `path` when
    whole)."""
    return f"{temp_stem(path)}{TEMP_MARK}{uuid.uuid4().hex}"


def temp_stem(path: str) -> str:
    """What the temporary names of `path` start with: `path` itself, or, when its name is too long to take the
    ".tmp-<hex>" suffix within NAME_MAX bytes (a name as long as the folder allows is still written), the name's
    first bytes and a digest of the whole name."""
    folder, name = posixpath.split(path)
    raw = os.fsencode(name)
    if len(raw) + len(TEMP_MARK) + 32 <= NAME_MAX:
        return path
    return posixpath.join(folder, os.fsdecode(raw[:NAME_MAX - len(TEMP_MARK) - 32 - 17]) + "~"
                          + hashlib.sha256(raw).hexdigest()[:16])


@contextmanager
def replacing(path: str, files_only: bool = False, held: bool = False):
    """Write-then-rename, the project's one: yields a temporary local path beside `path`; when the block ends
    without an error the file there becomes `path` at once (os.replace), otherwise it is removed. No reader and
    no crash ever sees a partial file under `path` (a process killed inside the block leaves temp_name()'s file).
    files_only (a file a user names, as a command's output): only nothing or a regular file at `path` is replaced;
    a symbolic link (never written through either), a folder, a FIFO or a device there is a FileExistsError naming
    it, before the block and again just before the rename, and left as it is. held: the temporary file is held
    while it is written (held_temp), so that remove_temp_files(..., unless_held=True) removes a killed writer's only."""
    if files_only:
        only_a_file(path)
    if held:
        with held_temp(path) as tmp:
            yield tmp
            if files_only:
                only_a_file(path)
            os.replace(tmp, path)
        return
    tmp = temp_name(path)
    try:
        yield tmp
        if files_only:
            only_a_file(path)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def only_a_file(path: str) -> None:
    """FileExistsError unless nothing or a regular file is at the local `path` (os.lstat: a link is not followed)."""
    import stat
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        what = ("a symbolic link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode)
                else "no regular file (a FIFO, a device or a socket)")
        raise FileExistsError(f"{path} is {what}, not a file this command may replace: it is left as it is; move it "
                              "away or name another output")


def atomic_write(fs, path: str, data: bytes, create: bool = False, files_only: bool = False) -> None:
    """Write `path` so that no reader (and no crash) ever leaves a partial file under that name: a local file
    through replacing() (files_only: see there); an object store PUT is atomic by itself. create=True: FileExistsError
    when something other than `data` is at `path`, never replaced (locally a hard link of the written file, atomic;
    on S3 a conditional PUT, If-None-Match: *; elsewhere a check just before the PUT); the same bytes there (this
    write done before, or its retried PUT) are no conflict."""
    if is_local_fs(fs):
        if create:
            tmp = temp_name(path)
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                try:
                    os.link(tmp, path, follow_symlinks=False)
                except FileExistsError:
                    if not _holds(path, data):
                        raise FileExistsError(path) from None
                except OSError:         # no hard links there: check, then rename
                    if os.path.lexists(path):
                        if not _holds(path, data):
                            raise FileExistsError(path) from None
                    else:
                        os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
            return
        with replacing(path, files_only) as tmp, open(tmp, "wb") as f:
            f.write(data)
    elif create and {"s3", "s3a"} & set(fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)):
        try:
            fs.pipe_file(path, data, mode="create")     # s3fs: FileExistsError when the object is there
        except FileExistsError:     # someone else's, or this PUT's own retry (its first try went through)
            if fs.size(path) != len(data) or (data and fs.cat_file(path) != data):
                raise FileExistsError(path) from None
    else:
        if create and fs.exists(path):
            if fs.size(path) != len(data) or (data and fs.cat_file(path) != data):
                raise FileExistsError(path)
            return
        fs.pipe_file(path, data)


def _holds(path: str, data: bytes) -> bool:
    """Whether the local `path` is a regular file (not a link) holding exactly `data` (read at most its length + 1)."""
    import stat
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode) or st.st_size != len(data):
        return False
    with open(path, "rb") as f:
        return f.read(len(data) + 1) == data


def release_written(fs, path: str) -> None:
    """A finished local file's data to disk and its pages out of the page cache (fdatasync, then
    POSIX_FADV_DONTNEED), so that the next file reuses those pages: on this project's KVM machines writing into
    fresh page-cache pages costs several times more kernel time (benchmarks/README.md, host cost, "Writing
    files"). Nothing on object stores, nor where the OS has no posix_fadvise."""
    if not is_local_fs(fs) or not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def remove_temp_files(fs, root: str, names: tuple[str, ...], unless_held: bool = False) -> None:
    """atomic_write's temporary files of `names` under `root`, left by a process killed between writing
    and renaming (local only: object stores have none). unless_held: only those no live process holds (held_temp():
    a writer with no lease, as the elmo command, may overlap another on one name). `root` and the names are matched
    literally (a folder named out[1] is not out1, whose files are another run's); only regular files are temporary
    files (a folder, link or FIFO of that name is no writer's, left as it is)."""
    import fcntl
    import stat
    if is_local_fs(fs):
        for name in names:
            for p in fs.glob(glob_escape(temp_stem(posixpath.join(root, name))) + TEMP_MARK + "*"):
                if not TEMP_NAME.search(p):
                    continue
                try:
                    if not stat.S_ISREG(os.lstat(p).st_mode):
                        continue
                except FileNotFoundError:
                    continue
                if unless_held:
                    try:
                        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
                    except OSError:
                        continue
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError:
                        continue        # a live writer's
                    finally:
                        os.close(fd)
                fs.rm_file(p)


def glob_escape(name: str) -> str:
    """`name` with glob's special characters matched literally."""
    return re.sub(r"([*?\[])", r"[\1]", name)


@contextmanager
def held_temp(path: str):
    """A new temporary file beside `path` (temp_name), created empty and held (an exclusive flock, released when
    the block ends or the process dies) so that remove_temp_files(..., unless_held=True) of another process leaves
    it; yields its name, removed when the block ends unless it was moved."""
    import fcntl
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield tmp
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.close(fd)


class NotTheRecordedFile(ValueError):
    """A file read back is not the one its writer recorded (size, SHA-256), or no regular file."""


def check_recorded(fs, path: str, record: dict, digest: bool = True) -> None:
    """NotTheRecordedFile unless `path` is a regular file (a FIFO, a device or a folder is never opened) of the
    recorded size ({"bytes", "sha256"}) and, with `digest`, SHA-256, streamed in blocks: at most bytes + 1 read."""
    import stat
    if is_local_fs(fs):
        try:
            st = os.stat(path)
        except OSError as e:
            raise NotTheRecordedFile(f"{path}: cannot be read ({e.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise NotTheRecordedFile(f"{path}: not a regular file (a file of {record['bytes']} bytes is recorded)")
        size = st.st_size
    else:
        size = fs.size(path)
    if size != record["bytes"]:
        raise NotTheRecordedFile(f"{path}: {size} bytes, {record['bytes']} recorded")
    if digest and not same_digest(fs, path, record):
        raise NotTheRecordedFile(f"{path}: not the file its writer recorded (another SHA-256)")


def digest_of(fs, path: str) -> dict:
    """{"bytes", "sha256"} of the file at `path`, read in 8 MiB blocks (a file this process chose to trust: its own
    staged file)."""
    import hashlib
    h, size = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
            size += len(block)
    return {"bytes": size, "sha256": h.hexdigest()}


def same_digest(fs, path: str, record: dict, copy_to=None) -> bool:
    """Whether `path` holds record["bytes"] bytes of SHA-256 record["sha256"], read in 8 MiB blocks: at most that
    + 1 bytes read (a file grown since, or /dev/zero, is never read whole). copy_to: a binary stream each block
    read is written to as well (a copy checked in the same pass)."""
    import hashlib
    h, left = hashlib.sha256(), record["bytes"] + 1
    with fs.open(path, "rb") as f:
        while left > 0 and (block := f.read(min(left, 8 << 20))):
            h.update(block)
            left -= len(block)
            if copy_to is not None:
                copy_to.write(block)
    return left == 1 and h.hexdigest() == record["sha256"]


def read_whole(f, limit: int, path: str) -> bytes:
    """At most `limit` bytes (< 0: all) of the open file `f`; ConnectionError when fewer came than its size says (an
    answer cut short by the store or a proxy that rewrote its length: a storage failure, retried later, never taken
    for a damaged or missing file)."""
    data = f.read(limit) if limit >= 0 else f.read()
    size = getattr(f, "size", None)
    want = size if limit < 0 or type(size) is not int else min(size, limit)
    if type(want) is int and len(data) < want:
        raise ConnectionError(f"{path}: {len(data)} bytes came of the {want} asked (the store cut its answer short)")
    return data


def read_recorded(fs, path: str, record: dict | None) -> bytes:
    """The bytes of `path`, checked against the record its writer kept ({"bytes", "sha256"}: manifest.json
    "files"): at most bytes + 1 read, a local path opened only when it is a regular file (a FIFO never blocks a
    read, /dev/zero never fills memory). NotTheRecordedFile otherwise. record None (an output of a version that
    recorded none): the file as it is, not verified."""
    import hashlib
    import stat
    if is_local_fs(fs):
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise NotTheRecordedFile(f"{path}: not a regular file")
    with fs.open(path, "rb") as f:
        data = read_whole(f, -1 if record is None else int(record["bytes"]) + 1, path)
    if record is not None and (len(data) != record["bytes"] or hashlib.sha256(data).hexdigest() != record["sha256"]):
        raise NotTheRecordedFile(f"{path}: not the file its manifest records ({len(data) if len(data) <= record['bytes'] else 'more than ' + str(record['bytes'])} bytes read, {record['bytes']} recorded, or another SHA-256)")
    return data


MAX_JSON_BYTES = 256 << 20      # a small file read back as JSON (manifest, finalize plan, lease, record): at most this


def json_lines(data: bytes) -> list[str]:
    """The non-empty lines of a JSON Lines file's bytes (UTF-8, damaged bytes replaced), split at \n only:
    str.splitlines() also splits at U+0085, U+2028, U+2029, \x1c-\x1e, which a JSON string written with
    ensure_ascii=False holds as they are."""
    return [line for line in data.decode("utf-8", "replace").split("\n") if line]


def json_or_none(data: bytes):
    """The JSON value of `data`, None when it is not JSON (or nested deeper than the parser's recursion allows)."""
    import json
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def read_json(fs, path: str, max_bytes: int = MAX_JSON_BYTES):
    """The JSON value of the file at `path`, read back as the pipeline's small files are: at most max_bytes + 1
    bytes, a local path opened only when it is a regular file (a FIFO never blocks, /dev/zero never fills
    memory). None when it is not JSON, larger than max_bytes or no regular file; FileNotFoundError when absent."""
    import stat
    if is_local_fs(fs) and not stat.S_ISREG(os.stat(path).st_mode):
        return None
    with fs.open(path, "rb") as f:
        data = read_whole(f, max_bytes + 1, path)
    return json_or_none(data) if len(data) <= max_bytes else None
