"""Tokenize a corpus once into a token store (nnx_zoo/data/token_store.py): what `zoo-data` runs.

The work is cut into pieces, one shard each, in corpus order: a file; a byte range of a .jsonl
(cut at line starts) or .txt (cut right after a paragraph break that follows text, where the
whole-file split of data/sources.py breaks too, so the documents are the ones a run reading the
text would see); a range of a Parquet file's row groups. A pool of `num_workers` processes
tokenizes the pieces, streaming lines and row batches (memory per worker: one document, one
Parquet batch, the shard's lengths), never a whole file.

Resumable: `OUT/run.json` records the arguments (files with sizes and modification times,
tokenizer identity, format, text field, shard size) when a run starts; each finished shard gets
`shard-NNNNN.done` (written atomically after its ArrayRecord and lengths are closed and renamed
into place), and `index.json` comes last, so a killed run leaves no index and a second run with
the same arguments tokenizes only the pieces without a done marker. A non-empty OUT that is
neither is refused; `overwrite` replaces an earlier store or unfinished run (only the files
zoo-data writes: anything else there is refused). A finished store is replaced whole: the new
one is made beside it (`OUT.zoo-data-new`) and renamed into place once its index is written, so
a run that fails or is killed on the way leaves the old store as it was.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import re
import sys
import time

import numpy as np

from nnx_zoo.data import chat, sources, token_store
from nnx_zoo.data.tokenizers import make_tokenizer
from nnx_zoo.errors import UsageError
from nnx_zoo.runtime import storage
from nnx_zoo.runtime.files import write_json_atomic

RUN_FILE = "run.json"
DEFAULT_SHARD_BYTES = 128 * 2**20
_TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
_RECORD_SUFFIXES = (".jsonl", ".parquet")
_OURS = re.compile(
    r"^(index\.json|run\.json|shard-\d{5}\.(arrayrecord|lengths\.npy|done)|\.tmp-.*)$"
)
_BLANK_LINE = re.compile(rb"^[ \t]*\n$")
_REPORT_EVERY = 256  # documents between updates of the shared progress counters


@dataclasses.dataclass(frozen=True)
class Request:
    source: str
    tokenizer: str
    out: str
    num_workers: int = 1
    data_format: str = "text"
    text_field: str = "text"
    overwrite: bool = False
    shard_bytes: int = DEFAULT_SHARD_BYTES


@dataclasses.dataclass(frozen=True)
class Piece:
    path: str
    kind: str  # 'jsonl' | 'txt': bytes [start, end); 'parquet': row groups [start, end)
    start: int
    end: int
    nbytes: int  # its share of the file, for progress


# ----------------------------------------------------------------------------- pieces


def _files(request: Request) -> list[str]:
    if token_store.is_store(request.source):
        raise UsageError(f"--source={request.source!r} is already a token store")
    files = sources._expand(request.source)
    allowed = _TEXT_SUFFIXES if request.data_format == "text" else _RECORD_SUFFIXES
    for path in files:
        if not path.endswith(allowed):
            raise UsageError(
                f"unsupported file {path!r} for --format={request.data_format}: expected "
                f"{', '.join(allowed)}"
            )
    return files


def _line_start(f, offset: int) -> int:
    """The first line start at or after `offset`."""
    if offset == 0:
        return 0
    f.seek(offset - 1)
    f.readline()
    return f.tell()


def _paragraph_cut(f, offset: int, size: int) -> int:
    """The end of the first paragraph break at or after `offset` that follows text: a blank
    line ([ \\t]*) after a line ending in a character other than space or tab. The whole-file
    split (`\\n[ \\t]*\\n`, left to right) breaks there too, whatever came before."""
    f.seek(_line_start(f, offset))
    previous = b""
    while True:
        line = f.readline()
        if not line:
            return size
        stripped = previous.rstrip(b"\n")
        if _BLANK_LINE.match(line) and stripped and stripped[-1:] not in (b" ", b"\t"):
            return f.tell()
        previous = line


def plan_pieces(files: list[str], shard_bytes: int) -> list[Piece]:
    pieces = []
    for path in files:
        size = os.path.getsize(path)
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            try:
                meta = pq.ParquetFile(path).metadata
            except Exception as e:  # noqa: BLE001 -- pyarrow raises several kinds
                raise UsageError(f"{path}: not a readable Parquet file ({e})") from None
            start, acc = 0, 0
            for g in range(meta.num_row_groups):
                acc += meta.row_group(g).total_byte_size
                if acc >= shard_bytes or g == meta.num_row_groups - 1:
                    share = size * (g + 1 - start) // max(meta.num_row_groups, 1)
                    pieces.append(Piece(path, "parquet", start, g + 1, share))
                    start, acc = g + 1, 0
            continue
        kind = "jsonl" if path.endswith(".jsonl") else "txt"
        cuts = [0]
        with open(path, "rb") as f:
            while cuts[-1] < size:
                nominal = cuts[-1] + shard_bytes
                if nominal >= size:
                    cuts.append(size)
                    break
                cut = (
                    _line_start(f, nominal) if kind == "jsonl" else _paragraph_cut(f, nominal, size)
                )
                cuts.append(cut)
        if size == 0:
            cuts.append(0)
        pieces += [Piece(path, kind, a, b, b - a) for a, b in zip(cuts, cuts[1:], strict=False)]
    return pieces


# ----------------------------------------------------------------------------- reading a piece


def _lines(piece: Piece):
    """(byte offset, raw line) of the piece's lines."""
    with open(piece.path, "rb") as f:
        f.seek(piece.start)
        offset = piece.start
        while offset < piece.end:
            line = f.readline()
            if not line:
                return
            yield offset, line
            offset += len(line)


def _decode(raw: bytes, path: str, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{path}: byte {offset + e.start}: not UTF-8 text (0x{raw[e.start]:02x}); data "
            "files must be UTF-8"
        ) from None


def _paragraphs(piece: Piece):
    """The .txt piece's documents, as data/sources.py splits the whole file: the regex runs
    over the lines gathered since the last break, whenever a blank line may close one."""
    lines: list[str] = []
    for offset, line in _lines(piece):
        lines.append(_decode(line, piece.path, offset))
        if not line.strip(b" \t\n") and len(lines) > 1:
            *done, rest = sources._PARAGRAPH_BREAK.split("".join(lines))
            lines = [rest] if rest else []
            for text in done:
                if text.strip():
                    yield text.strip("\n")
    for text in sources._PARAGRAPH_BREAK.split("".join(lines)):
        if text.strip():
            yield text.strip("\n")


def _json_lines(piece: Piece):
    for offset, raw in _lines(piece):
        line = _decode(raw, piece.path, offset)
        if not line.strip():
            continue
        where = f"{piece.path}: byte {offset}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{where}: not valid JSON at column {e.colno} ({e.msg})") from None


def _parquet_rows(piece: Piece, columns: list[str], fix: str):
    import pyarrow.parquet as pq

    f = pq.ParquetFile(piece.path)
    names = f.schema_arrow.names
    missing = [c for c in columns if c not in names]
    if missing:
        raise UsageError(f"{piece.path}: no column {missing[0]!r} (columns: {names}); {fix}")
    row = sum(f.metadata.row_group(g).num_rows for g in range(piece.start))
    groups = list(range(piece.start, piece.end))
    for batch in f.iter_batches(batch_size=1024, row_groups=groups, columns=columns):
        for record in batch.to_pylist():
            yield f"{piece.path}: row {row}", record
            row += 1


def _texts(piece: Piece, text_field: str):
    if piece.kind == "txt":
        yield from _paragraphs(piece)
        return
    rows = (
        _json_lines(piece)
        if piece.kind == "jsonl"
        else _parquet_rows(
            piece, [text_field], "set --text_field to the column that holds the text"
        )
    )
    for where, record in rows:
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            if piece.kind == "parquet" and text is None:
                continue
            raise UsageError(
                f"{where}: expected a JSON object with a string field {text_field!r} "
                f"(--text_field), got {json.dumps(record)[:40]}"
            )
        if text:
            yield text


def _records(piece: Piece, data_format: str):
    fields = ["messages"] if data_format == "chat" else ["prompt", "completion"]
    rows = (
        _json_lines(piece)
        if piece.kind == "jsonl"
        else _parquet_rows(
            piece, fields, f"--format={data_format} reads the columns {', '.join(fields)}"
        )
    )
    for where, record in rows:
        yield chat.check_record(record, data_format, where)


# ----------------------------------------------------------------------------- workers

_WORKER: dict = {}


def _init_worker(spec: str, data_format: str, text_field: str, counters) -> None:
    tokenizer = make_tokenizer(spec)
    template = None
    if data_format != "text" and spec != "byte":
        try:
            template = chat.ChatTemplate.from_dir(os.path.expanduser(spec))
        except ValueError:
            if data_format == "chat":
                raise
    _WORKER.update(
        tokenizer=tokenizer, template=template, data_format=data_format, text_field=text_field
    )
    _WORKER["counters"] = counters


def _add(counters, values) -> None:
    with counters.get_lock():
        for i, v in enumerate(values):
            counters[i] += v


def _tokenize_piece(directory: str, i: int, piece: Piece) -> dict:
    """Write shard i from `piece`, then its done marker; its figures."""
    tok, counters = _WORKER["tokenizer"], _WORKER["counters"]
    data_format = _WORKER["data_format"]
    started = time.perf_counter()
    writer = token_store.ShardWriter(directory, i)
    pending = [0, 0, 0]  # documents, tokens, bytes not yet reported
    try:
        if data_format == "text":
            encode_np = getattr(tok, "encode_np", None)
            for text in _texts(piece, _WORKER["text_field"]):
                ids = encode_np(text) if encode_np else np.asarray(tok.encode(text), np.int32)
                writer.write(ids)
                pending[0] += 1
                pending[1] += len(ids)
                if pending[0] >= _REPORT_EVERY:
                    _add(counters, pending)
                    pending = [0, 0, 0]
        else:
            for record in _records(piece, data_format):
                encoded = chat.encode_record(record, tok, _WORKER["template"])
                writer.write(encoded["tokens"], encoded["loss_mask"])
                pending[0] += 1
                pending[1] += len(encoded["tokens"])
    except BaseException:
        writer.abort()
        raise
    shard = writer.close()
    pending[2] = piece.nbytes
    _add(counters, pending)
    done = {
        **shard,
        "piece": dataclasses.asdict(piece),
        "seconds": time.perf_counter() - started,
        "worker": os.getpid(),
    }
    write_json_atomic(os.path.join(directory, _done_name(i)), done)
    return done


def _done_name(i: int) -> str:
    return f"shard-{i:05d}.done"


# ----------------------------------------------------------------------------- the run


def _run_record(request: Request, files: list[str], tokenizer) -> dict:
    return {
        "format": token_store.FORMAT,
        "sources": [
            {"path": os.path.abspath(p), "bytes": os.path.getsize(p), "mtime": os.path.getmtime(p)}
            for p in files
        ],
        "tokenizer": token_store.tokenizer_identity(tokenizer, request.tokenizer),
        "data_format": request.data_format,
        "text_field": request.text_field,
        "shard_bytes": request.shard_bytes,
    }


def _prepare_out(request: Request, record: dict) -> bool:
    """Make OUT ready; True when it holds an unfinished run of these arguments to continue."""
    out = request.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out={out!r} is a file; give a new or empty directory")
    names = os.listdir(out) if os.path.isdir(out) else []
    if not names:
        os.makedirs(out, exist_ok=True)
        return False
    foreign = [n for n in names if not _OURS.match(n)]
    ours = token_store.INDEX in names or RUN_FILE in names
    if foreign or not ours:
        raise UsageError(
            f"--out={out!r} is not empty and holds files zoo-data did not write "
            f"({', '.join(sorted(foreign or names)[:3])}); give a new or empty directory"
        )
    if request.overwrite:  # an unfinished run's files: nothing readable is lost
        for name in names:
            os.remove(os.path.join(out, name))
        return False
    if token_store.INDEX in names:
        raise UsageError(
            f"--out={out!r} already holds a finished token store; pass --overwrite to replace it"
        )
    with open(os.path.join(out, RUN_FILE), encoding="utf-8") as f:
        earlier = json.load(f)
    if earlier != json.loads(json.dumps(record)):
        changed = [k for k in record if earlier.get(k) != json.loads(json.dumps(record[k]))]
        raise UsageError(
            f"--out={out!r} holds an unfinished zoo-data run of other arguments (differing: "
            f"{', '.join(changed) or 'format'}); pass --overwrite to start over, or the same "
            "arguments to continue it"
        )
    return True


def _finished(out: str, pieces: list[Piece]) -> dict[int, dict]:
    done = {}
    for i, piece in enumerate(pieces):
        path = os.path.join(out, _done_name(i))
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            marker = json.load(f)
        if marker.get("piece") == dataclasses.asdict(piece):
            done[i] = marker
    return done


def tokenize_corpus(request: Request, *, log=None) -> dict:
    """Tokenize `request.source` into a store at `request.out`; its index. Progress (documents,
    tokens, MB/s, ETA) goes to stderr, then the tokens/s of each worker. UsageError /
    UsageError (one line) for bad input."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    if storage.is_url(request.out):
        return _tokenize_to_bucket(request, log)
    if request.data_format not in chat.FORMATS:
        raise UsageError(f"--format={request.data_format!r}; valid: {', '.join(chat.FORMATS)}")
    if request.num_workers < 1 or request.shard_bytes < 1:
        raise UsageError("--num_workers and --shard_bytes must be at least 1")
    files = _files(request)
    tokenizer = make_tokenizer(request.tokenizer)
    if request.data_format == "chat" and request.tokenizer == "byte":
        raise UsageError(
            "--format=chat needs the checkpoint's tokenizer directory (its chat "
            "template), not 'byte'"
        )
    record = _run_record(request, files, tokenizer)
    _restore_if_swap_was_cut(request.out, log)
    if request.overwrite and token_store.is_store(request.out):
        return _replace_store(request, log)
    resuming = _prepare_out(request, record)
    out = request.out
    write_json_atomic(os.path.join(out, RUN_FILE), record)
    pieces = plan_pieces(files, request.shard_bytes)
    done = _finished(out, pieces) if resuming else {}
    for name in os.listdir(out):  # a killed run's partial files
        if name.startswith(".tmp-"):
            os.remove(os.path.join(out, name))
    todo = [i for i in range(len(pieces)) if i not in done]
    if resuming:
        log(f"continuing: {len(done)} of {len(pieces)} shards already done")
    results = dict(done)
    results.update(_run_pieces(request, pieces, todo, log))
    index = _index(request, record, pieces, results)
    token_store.write_index(out, index)
    return index


def _restore_if_swap_was_cut(out: str, log) -> None:
    """A replacement killed between its two renames leaves OUT missing and the old store
    beside it: that store goes back in place before anything else."""
    out = os.path.normpath(out)
    old = out + ".zoo-data-old"
    if not os.path.exists(out) and token_store.is_store(old):
        os.rename(old, out)
        log(f"restored {out} (a replacement of it was stopped before it finished)")


def _replace_store(request: Request, log) -> dict:
    """--overwrite of a finished store: readers keep the old one until the new one is whole."""
    import shutil

    out = os.path.normpath(request.out)
    foreign = [n for n in os.listdir(out) if not _OURS.match(n)]
    if foreign:
        raise UsageError(
            f"--out={out!r} is not empty and holds files zoo-data did not write "
            f"({', '.join(sorted(foreign)[:3])}); give a new or empty directory"
        )
    new, old = out + ".zoo-data-new", out + ".zoo-data-old"
    for leftover in (new, old):  # a replacement killed before its swap (our names only)
        if os.path.isdir(leftover):
            shutil.rmtree(leftover)
    try:
        index = tokenize_corpus(dataclasses.replace(request, out=new, overwrite=False), log=log)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    os.rename(out, old)
    os.rename(new, out)
    shutil.rmtree(old)
    return index


def _run_pieces(request: Request, pieces, todo, log) -> dict[int, dict]:
    from tqdm import tqdm

    ctx = multiprocessing.get_context("spawn")
    counters = ctx.Array("q", 3)  # documents, tokens, bytes
    args = (request.tokenizer, request.data_format, request.text_field, counters)
    total = sum(pieces[i].nbytes for i in todo)
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        desc="tokenizing",
        mininterval=0.5,
        smoothing=0.1,
    )

    def show():
        docs, tokens, nbytes = counters[:]
        bar.set_postfix_str(f"{docs:,} documents, {tokens:,} tokens", refresh=False)
        bar.update(nbytes - bar.n)

    results = {}
    started = time.perf_counter()
    try:
        if request.num_workers == 1 or len(todo) <= 1:
            _init_worker(*args)
            for i in todo:
                results[i] = _tokenize_piece(request.out, i, pieces[i])
                show()
        else:
            workers = min(request.num_workers, len(todo))
            with ctx.Pool(workers, initializer=_init_worker, initargs=args) as pool:
                pending = {
                    i: pool.apply_async(_tokenize_piece, (request.out, i, pieces[i])) for i in todo
                }
                while pending:
                    time.sleep(0.2)
                    for i in [i for i, r in pending.items() if r.ready()]:
                        results[i] = pending.pop(i).get()  # a worker's error raises here
                    show()
        show()
    finally:
        bar.close()
    wall = time.perf_counter() - started
    if results:
        per_worker: dict[int, list[float]] = {}
        for r in results.values():
            tokens_seconds = per_worker.setdefault(r["worker"], [0, 0.0])
            tokens_seconds[0] += r["tokens"]
            tokens_seconds[1] += r["seconds"]
        rates = [t / max(s, 1e-9) for t, s in per_worker.values()]
        tokens = sum(r["tokens"] for r in results.values())
        log(
            f"tokenized {tokens:,} tokens in {wall:.1f} s: {tokens / max(wall, 1e-9):,.0f} "
            f"tokens/s; per worker {', '.join(f'{r:,.0f}' for r in rates)} tokens/s "
            f"({len(rates)} workers)"
        )
    return results


def _index(request: Request, record: dict, pieces, results) -> dict:
    shards = [
        {k: results[i][k] for k in ("file", "lengths", "documents", "tokens")}
        for i in range(len(pieces))
    ]
    return {
        "format": token_store.FORMAT,
        "version": token_store.VERSION,
        "tokenizer": record["tokenizer"],
        "data_format": request.data_format,
        "text_field": request.text_field,
        "documents": sum(s["documents"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "sources": [{"path": s["path"], "bytes": s["bytes"]} for s in record["sources"]],
        "shards": shards,
    }


def _tokenize_to_bucket(request: Request, log) -> dict:
    """--out=gs://... / s3://...: the store is made in a local staging directory (under
    $TMPDIR), then uploaded with index.json last, so a prefix holds a store exactly when it
    holds its index. A killed run is not continued there: its partial upload (shards
    without an index) is replaced with --overwrite."""
    import shutil
    import tempfile

    out = storage.normalize(request.out)
    try:
        names = storage.listdir(out)
    except Exception as e:  # noqa: BLE001 -- the store's own failure: the URL and its message
        raise storage.error(out, e, "be read") from None
    foreign = [n for n in names if not _OURS.match(n)]
    if foreign:
        raise UsageError(
            f"--out={out!r} is not empty and holds objects zoo-data did not write "
            f"({', '.join(sorted(foreign)[:3])}); give a new or empty prefix"
        )
    if names and not request.overwrite:
        what = "a finished token store" if token_store.INDEX in names else "an unfinished upload"
        raise UsageError(f"--out={out!r} already holds {what}; pass --overwrite to replace it")
    storage.check_writable(out)  # before the work, not after it
    staging = tempfile.mkdtemp(prefix="nnx-zoo-data-")
    try:
        local = os.path.join(staging, "store")
        index = tokenize_corpus(dataclasses.replace(request, out=local), log=log)
        if names:
            storage.rmtree(out)  # only what an earlier zoo-data wrote (checked above)
        storage.upload_tree(local, out, last=(token_store.INDEX,))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return index
