"""`elmo-pipeline elmo`: the removed `allennlp elmo` command, same flags and HDF5 layout.

INPUT_FILE: one whitespace-tokenized sentence per line (path or fsspec URL).
OUTPUT_FILE: HDF5 with one dataset per line index ("0", "1", ...): (n_layers+1, T, D) for --all,
(T, D) for --top / --average; plus "sentence_to_index", a JSON object {sentence: index} in a
1-element variable-length string dataset, unless --forget-sentences. A blank line gives a
zero-length dataset and a warning.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import stat
import sys
import time

logger = logging.getLogger("elmo-pipeline.elmo")

WRITTEN_BY = ("written_by", "elmo-pipeline elmo")     # the root attribute that marks OUTPUT_FILE as this command's


def add_arguments(p: argparse.ArgumentParser) -> None:
    from elmo_pipeline.model.options import COMPUTE_DTYPES, STATE_MODES
    p.add_argument("input_file", help="one whitespace-tokenized sentence per line (path or URL)")
    p.add_argument("output_file", help="HDF5 file to write")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--all", action="store_true", help="all layers: (n_layers+1, T, D) per sentence")
    what.add_argument("--top", action="store_true", help="top LSTM layer: (T, D)")
    what.add_argument("--average", action="store_true", help="average of all layers: (T, D)")
    p.add_argument("--model", help="a model by name (`elmo-pipeline models`; published ones are downloaded on first "
                   "use); default: the shipped model")
    p.add_argument("--options-file", help="options.json (default: the shipped model)")
    p.add_argument("--weight-file", help="weights.hdf5 (default: the shipped model)")
    p.add_argument("--vocab-file", help="vocabulary, for word-encoder models only")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per batch (default 64)")
    p.add_argument("--max-tokens-per-batch", type=int, default=0,
                   help="batch by a token budget (token slots, <S> </S> included) instead of --batch-size; "
                   "stateless/warm only; 8192-16384 is fastest on a CPU (default 0: --batch-size)")
    p.add_argument("--cuda-device", type=int, default=-1, help="GPU index; -1 for the CPU (default)")
    p.add_argument("--compute-dtype", choices=COMPUTE_DTYPES, default="float32",
                   help="precision the biLM runs in: float32 (default, exact), bfloat16 or float16 (faster only where "
                   "the hardware runs them natively: GPUs, and for bfloat16 CPUs with AVX512_BF16 or AMX; "
                   "`elmo-pipeline doctor` tells); the file holds float32 either way")
    p.add_argument("--forget-sentences", action="store_true", help="do not write sentence_to_index")
    p.add_argument("--use-sentence-keys", action="store_true", help="key datasets by the sentence text, not the line index")
    p.add_argument("--state", choices=STATE_MODES, default="stateless",
                   help="LSTM state mode (default stateless; stateful = AllenNLP/bilm-tf behaviour)")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=False,
                   help="bit-identical vectors for a sentence whatever the batching (--state stateless or warm; "
                   "docs/exactness.md; costs about 1-6%% of tokens/s, 2-3x for a sentence alone). Default off")
    p.add_argument("--window-tokens", type=int, default=0,
                   help="embed sentences longer than this as overlapping windows, stitched (model/windows.py); "
                   "default 0: whole sentences, as AllenNLP (memory grows with the longest sentence)")
    p.add_argument("--window-overlap", type=int, default=None,
                   help="tokens shared by consecutive windows (default 200, at most --window-tokens / 5)")


def read_lines(url: str) -> list[str]:
    """Lines of a text file, stripped: read by the pipeline's line reader (split on b"\\n" only, not on U+2028
    etc.; strict UTF-8; CRLF and a UTF-8 byte-order mark dropped). Anything the pipeline would dead-letter
    (invalid UTF-8, a line over --max-record-bytes' default, a file that is not UTF-8 text with LF or CRLF line
    ends) exits with one `error:` line naming the line, before the model is loaded."""
    from elmo_pipeline.formats.layout import DeadLetter
    from elmo_pipeline.fsio import open_url
    from elmo_pipeline.transforms.lines import Meter
    from elmo_pipeline.transforms.read import line_records
    from elmo_pipeline.transforms.records import Blank
    lines = []
    with open_url(url, "rb") as f:
        for r in line_records(f, Meter(f), "lines", "line", "text", None):
            if isinstance(r, Blank):
                lines.append("")
            elif isinstance(r, DeadLetter):
                raise SystemExit(f"error: INPUT_FILE {r.id.replace(':', ' ')}: {r.reason}")
            else:
                lines.append(r.text.strip())
    return lines


def claim_output(path: str) -> os.stat_result | None:
    """What is at OUTPUT_FILE before the command writes it: None when nothing is; the file's stat when it is a file
    this command wrote (its root attribute WRITTEN_BY), replaced once the new one is whole; anything else (a user's
    file, an HDF5 file of another writer, a symbolic link, a folder, a FIFO, a device) exits with one line, left as
    it is: the command never writes through a link nor over a file it did not write."""
    folder = os.path.dirname(path) or "."
    if not os.path.basename(path):          # "" or a folder's name ending in "/"
        raise SystemExit(f"error: OUTPUT_FILE {path!r} names no file")
    if not os.path.isdir(folder):
        raise SystemExit(f"error: OUTPUT_FILE {path}: {folder} is no folder")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    what = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode)
            else None if stat.S_ISREG(st.st_mode) else "no regular file (a FIFO, a device or a socket)")
    if what is None and not _ours(path, st):
        what = "a file this command did not write"
    if what:
        raise SystemExit(f"error: OUTPUT_FILE {path} exists and is {what}: it is left as it is; move it away or "
                         "name another OUTPUT_FILE")
    return st


def _ours(path: str, st: os.stat_result | None = None) -> bool:
    """Whether the regular file at `path`, the very file `st` (its os.lstat; None: the file there now) describes, is
    an HDF5 file with this command's root attribute: read through one descriptor whose file is checked to be that one
    (a file swapped in between, e.g. the command's own, never vouches for the one place_output() would replace), and
    only when it starts with HDF5's signature; any failure to read it: not ours."""
    import h5py
    try:
        st = st or os.lstat(path)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "rb") as f:
            now = os.fstat(f.fileno())
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or f.read(8) != b"\x89HDF\r\n\x1a\n":
                return False
            f.seek(0)
            with h5py.File(f, "r") as h:         # that descriptor's file (no HDF5 file lock is taken)
                if WRITTEN_BY[0] not in h.attrs:
                    return False
                attr = h.attrs.get_id(WRITTEN_BY[0])      # one short string, checked before it is read
                if attr.shape not in ((), None) or attr.get_storage_size() > 1024:
                    return False
                mark = h.attrs[WRITTEN_BY[0]]
    except Exception:  # noqa: BLE001 - damaged, unreadable, a file of another kind: not ours
        return False
    return isinstance(mark, (str, bytes)) and (mark.decode() if isinstance(mark, bytes) else mark) == WRITTEN_BY[1]


def place_output(tmp: str, path: str, before: os.stat_result | None) -> None:
    """The whole file `tmp` becomes OUTPUT_FILE over what claim_output() saw there (fsio.place): anything placed there
    meanwhile exits with one line, left as it is."""
    from elmo_pipeline.fsio import place
    try:
        place(tmp, path, before)
    except FileExistsError:
        raise SystemExit(f"error: OUTPUT_FILE {path}: another file was placed there while the command ran: it is left "
                         "as it is; move it away and run the command again") from None


def run(args: argparse.Namespace) -> int:
    from elmo_pipeline.model.embedder import ElmoEmbedder
    from elmo_pipeline.model.resolve import resolve_model

    if args.batch_size < 1:
        raise SystemExit("error: --batch-size must be >= 1")
    if args.max_tokens_per_batch < 0:
        raise SystemExit("error: --max-tokens-per-batch must be >= 0")
    from elmo_pipeline.fsio import storage_error
    from elmo_pipeline.pipeline.validate import check_state, check_windows
    try:
        args.batch_invariant = check_state(args.state, budget_batches=args.max_tokens_per_batch > 0,
                                           windows=args.window_tokens > 0, batch_invariant=args.batch_invariant)
        if args.window_tokens:
            args.window_overlap = check_windows(args.window_tokens, args.window_overlap, args.window_tokens + 2)
        elif args.window_overlap is not None:     # else dropped: whole sentences, where windows were asked for
            raise ValueError("--window-overlap needs --window-tokens (the command embeds whole sentences by default)")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    before = claim_output(args.output_file)     # before anything is read or loaded: a refusal costs nothing
    try:
        lines = read_lines(args.input_file)
    except Exception as e:  # noqa: BLE001 - a storage or network failure: one line (cli.main redacts it)
        if not storage_error(e):
            raise
        raise SystemExit(f"error: INPUT_FILE {args.input_file}: {type(e).__name__}: {e}") from None
    if args.use_sentence_keys:
        bad = [s for s in lines if "/" in s or "\0" in s or s in ("", ".", "sentence_to_index")]
        if bad or len(set(lines)) != len(lines):       # HDF5 names: "/" nests, NUL ends one, "." is the file
            raise SystemExit("error: --use-sentence-keys needs unique, non-blank sentences without '/' or NUL, "
                             "other than '.'; "
                             f"first offending line: {bad[0] if bad else 'a duplicate sentence'!r}")
    common = dict(device=args.cuda_device, state=args.state, batch_size=args.batch_size, dtype=args.compute_dtype,
                  batch_invariant=args.batch_invariant)
    try:
        model = resolve_model(args.model, args.options_file, args.weight_file,
                              args.vocab_file if args.options_file else None)    # with files given only
        embedder = ElmoEmbedder.from_model(model, **common)
    except (ValueError, OSError) as e:   # unknown name, failed download, changed cached file
        raise SystemExit(f"error: {e}") from None
    for i, line in enumerate(lines):
        if not line:
            logger.warning("line %d is blank: writing a zero-length dataset", i)
    sentences = [line.split() for line in lines]
    t0 = time.perf_counter()              # after the model load, as AllenNLP's command timed itself
    long = {i: s for i, s in enumerate(sentences) if args.window_tokens and len(s) > args.window_tokens}
    # long lines' windows share sub-batches of --max-tokens-per-batch slots, else of --batch-size windows (the
    # memory of a batch of --batch-size lines as long as the window); never fewer than one whole window
    window_budget = max(args.window_tokens + 2,
                        args.max_tokens_per_batch or args.batch_size * (args.window_tokens + 2))
    group_of = {}      # long lines by group of windows that fill one sub-batch
    if long:
        from elmo_pipeline.model.windows import window_groups
        ids = list(long)
        for g in window_groups([len(long[i]) for i in ids], args.window_tokens, args.window_overlap, window_budget):
            members = [ids[k] for k in g]
            group_of.update(dict.fromkeys(members, members))
    from elmo_pipeline.fsio import held_temp, remove_temp_files, url_fs
    remove_temp_files(url_fs(args.output_file)[0], os.path.dirname(os.path.abspath(args.output_file)),
                      (os.path.basename(args.output_file),), unless_held=True)   # a killed run's, never a live one's
    with held_temp(args.output_file) as tmp:      # written whole beside it, then placed: a kill leaves the old file
        write_hdf5(tmp, args, lines, sentences, embedder, long, group_of, window_budget)
        place_output(tmp, args.output_file, before)
    secs = time.perf_counter() - t0
    n_tokens = sum(map(len, sentences))
    print(f"wrote {len(lines)} sentences to {args.output_file}: {n_tokens} tokens in {secs:.1f} s "
          f"({n_tokens / secs if secs else 0:.0f} tokens/s after loading the model)", file=sys.stderr)
    return 0


def write_hdf5(tmp, args, lines, sentences, embedder, long, group_of, window_budget) -> None:
    """The command's HDF5 file, written at `tmp` (a new name): a dataset per line, in AllenNLP's layout."""
    import h5py
    import numpy as np
    ready = {}
    batched = ([] if i in long else s for i, s in enumerate(sentences))
    if long:
        from elmo_pipeline.model.windows import embed_long_many
    with h5py.File(tmp, "w", locking=False) as fout:     # the empty file held_temp() made (and holds: its flock)
        fout.attrs[WRITTEN_BY[0]] = WRITTEN_BY[1]
        for i, vectors in enumerate(embedder.embed_sentences(batched, args.batch_size,
                                                                   args.max_tokens_per_batch or None)):
            if i in long:    # its group's windows together, as many as one batch of this command holds
                if i not in ready:
                    group = group_of[i]
                    ready.update(zip(group, embed_long_many(embedder, [long[j] for j in group], args.window_tokens,
                                                            args.window_overlap, window_budget)))
                vectors = ready.pop(i)
            if args.top:
                vectors = vectors[-1]
            elif args.average:
                vectors = np.average(vectors, axis=0) if vectors.shape[1] else vectors[-1]
            key = lines[i] if args.use_sentence_keys else str(i)
            fout.create_dataset(key, data=vectors.astype(np.float32, copy=False))
        if not args.forget_sentences:
            ds = fout.create_dataset("sentence_to_index", (1,), dtype=h5py.special_dtype(vlen=str))
            ds[0] = json.dumps({line: str(i) for i, line in enumerate(lines)})
