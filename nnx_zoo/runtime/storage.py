"""The project's own files on a local disk or in an object store (`gs://`, `s3://`), through
one file layer: fsspec, with gcsfs for `gs://` and s3fs for `s3://`.

Why fsspec: Orbax reaches object stores through etils `epath`, which itself goes through
fsspec (gcsfs, s3fs) when TensorFlow is absent, so these libraries are needed by every
object-store run anyway; and unlike `epath` fsspec exposes the one call a lock needs, a create
that fails when the object exists (`pipe_file(mode="create")`: GCS `ifGenerationMatch=0`,
S3 `If-None-Match: *`). TensorStore's kvstore has conditional writes too, but no listing of
"directories" and no streaming reads of a byte range for the data sources.

Local paths go through `os` exactly as before this module existed; every function here
branches on `is_url` first. Credentials come from each library's standard chain
(application-default credentials for gcsfs, the AWS chain for s3fs); an endpoint other than
the cloud's own comes from `STORAGE_EMULATOR_HOST` (GCS) or `AWS_ENDPOINT_URL` (S3). No
credential is ever read, printed or recorded here.

Failures reach the user as `UsageError`: one line naming the URL and the cloud's own message
(`error`); an object store answers a missing bucket or a denied write with a status code and
a message, not an errno.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import threading

from nnx_zoo.errors import UsageError

SCHEMES = ("gs://", "s3://")
# S3: how long one request may take to connect, and how often it is tried, so that an
# unreachable endpoint is reported in seconds, not after minutes of back-off (gcsfs fixes its
# own retries, 6, at import).
CONNECT_TIMEOUT_S = 10
ATTEMPTS = 3


def is_url(path: str) -> bool:
    return isinstance(path, str) and path.startswith(SCHEMES)


def scheme(path: str) -> str:
    return path.split("://", 1)[0]


def _environment() -> None:
    """Point TensorStore (Orbax's array writer) at the same GCS endpoint as gcsfs, and keep
    gcsfs from asking an emulator for the gRPC control plane it does not serve (gcsfs >= 2026
    looks up each bucket's layout there and waits a minute for every answer that never
    comes). Neither is set when the user set it."""
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator:
        if "://" not in emulator:
            emulator = f"http://{emulator}"
        os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", emulator)
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


_FILESYSTEMS: dict[str, object] = {}


def filesystem(url: str):
    """The fsspec filesystem of `url`'s scheme (one per process and scheme)."""
    kind = scheme(url)
    fs = _FILESYSTEMS.get(kind)
    if fs is None:
        _environment()
        import fsspec

        options = {}
        if kind == "s3":
            options["config_kwargs"] = {
                "connect_timeout": CONNECT_TIMEOUT_S,
                "retries": {"max_attempts": ATTEMPTS, "mode": "standard"},
            }
        try:
            # Not fsspec's instance cache: it would keep an endpoint the variables no longer name.
            if kind == "gs" and os.environ.get("STORAGE_EMULATOR_HOST"):
                # The plain JSON-API client, whichever class gcsfs registered at import.
                from gcsfs.core import GCSFileSystem as FileSystem
            else:
                FileSystem = fsspec.get_filesystem_class(kind)  # noqa: N806 -- a class
            fs = FileSystem(skip_instance_cache=True, **options)
        except ImportError as e:
            package = "gcsfs" if kind == "gs" else "s3fs"
            raise UsageError(
                f"{url}: {kind}:// paths need the {package} package ({e}); install it "
                "(pip install 'nnx-zoo[cloud]')"
            ) from None
        if kind == "s3":
            fs.retries = ATTEMPTS  # s3fs's own retries, around botocore's
        _FILESYSTEMS[kind] = fs
    return fs


def forget_filesystems() -> None:
    """Make the next request build its client again, from the variables as they are now
    (an endpoint or credentials changed within the process)."""
    _FILESYSTEMS.clear()


def _key(url: str) -> str:
    return url.split("://", 1)[1]


def join(base: str, *parts: str) -> str:
    if is_url(base):
        return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
    return os.path.join(base, *parts)


def normalize(url: str) -> str:
    """`url` without a trailing slash or doubled ones (as `os.path.abspath` tidies a path)."""
    head, _, rest = url.partition("://")
    return f"{head}://" + "/".join(p for p in rest.split("/") if p)


def dirname(path: str) -> str:
    if is_url(path):
        return path.rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(path)


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if is_url(path) else os.path.basename(path)


def error(url: str, exc: BaseException, doing: str = "") -> UsageError:
    """One line for a failed request: the URL, what was being done, the cloud's message."""
    from nnx_zoo.runtime.console import one_line

    message = one_line(exc) or type(exc).__name__
    if isinstance(exc, FileNotFoundError) and scheme(url) in ("gs", "s3"):
        message = f"not found ({message}); does the bucket exist?"
    elif isinstance(exc, PermissionError):
        message = f"permission denied ({message})"
    doing = f" {doing}" if doing else ""
    return UsageError(f"{url}: cannot{doing or ' be reached'} ({message[:300]})")


# --- reading ---------------------------------------------------------------------------------


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    return filesystem(path).exists(_key(path))


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs = filesystem(path)
    fs.invalidate_cache(_key(path))
    return fs.isdir(_key(path))


def isfile(path: str) -> bool:
    if not is_url(path):
        return os.path.isfile(path)
    return filesystem(path).isfile(_key(path))


def listdir(path: str) -> list[str]:
    """Names directly under `path` (files and "directories"); [] when there is none."""
    if not is_url(path):
        try:
            return os.listdir(path)
        except OSError:
            return []
    fs = filesystem(path)
    fs.invalidate_cache(_key(path))  # another process may have written since
    try:
        entries = fs.ls(_key(path), detail=False)
    except FileNotFoundError:
        return []
    prefix = _key(path).rstrip("/")
    return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != prefix})


def size(path: str) -> int:
    if not is_url(path):
        return os.path.getsize(path)
    return int(filesystem(path).info(_key(path))["size"])


def info(path: str) -> dict:
    """The object's metadata as the store gives it (size, generation or ETag, times)."""
    return filesystem(path).info(_key(path))


def modified(path: str) -> float:
    """When `path` was last written, in seconds since the epoch (the store's clock)."""
    if not is_url(path):
        return os.path.getmtime(path)
    return filesystem(path).modified(_key(path)).timestamp()


def open_read(path: str):
    """A binary file object for reading (ranged reads on an object store)."""
    if not is_url(path):
        return open(path, "rb")  # noqa: SIM115 -- the caller closes it
    return filesystem(path).open(_key(path), "rb")


def read_bytes(path: str) -> bytes:
    if not is_url(path):
        with open(path, "rb") as f:
            return f.read()
    return filesystem(path).cat_file(_key(path))


def walk_files(directory: str) -> list[str]:
    """Paths of every file under `directory`, relative to it with '/', sorted."""
    if not is_url(directory):
        out = []
        for root, _, names in os.walk(directory):
            for name in names:
                rel = os.path.relpath(os.path.join(root, name), directory)
                out.append(rel.replace(os.sep, "/"))
        return sorted(out)
    fs = filesystem(directory)
    prefix = _key(directory).rstrip("/") + "/"
    fs.invalidate_cache(prefix)
    return sorted(p[len(prefix) :] for p in fs.find(prefix) if p.startswith(prefix))


# --- writing ---------------------------------------------------------------------------------


def write_bytes(path: str, data: bytes) -> None:
    """Write a whole object in one request: an object store shows a reader either the old
    object or the complete new one, as a rename does on a local disk. Local paths: plain
    write (callers wanting atomicity use nnx_zoo/runtime/files.py)."""
    if not is_url(path):
        with open(path, "wb") as f:
            f.write(data)
        return
    filesystem(path).pipe_file(_key(path), data)


def create(path: str, data: bytes) -> bool:
    """Write `path` only if no object has that name (the store's precondition decides, so of
    two writers racing exactly one wins); False when it already exists."""
    if not is_url(path):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True
    try:
        filesystem(path).pipe_file(_key(path), data, mode="create")
    except FileExistsError:
        return False
    return True


def makedirs(path: str) -> None:
    """Local: `os.makedirs`. Object stores have no directories: a prefix exists once an
    object is written under it."""
    if not is_url(path):
        os.makedirs(path, exist_ok=True)


def remove(path: str) -> None:
    if not is_url(path):
        os.remove(path)
        return
    filesystem(path).rm_file(_key(path))


def rmtree(path: str) -> None:
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fs = filesystem(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(_key(path), recursive=True)
    fs.invalidate_cache(_key(path))


def move_tree(source: str, target: str) -> None:
    """Local: one rename. Object stores have no rename: every object is copied, then the
    source's deleted, so a reader may see both for a moment, never neither."""
    if not is_url(source):
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.move(source, target)
        return
    fs = filesystem(source)
    src = _key(source).rstrip("/")
    for rel in walk_files(source):
        fs.copy(f"{src}/{rel}", f"{_key(target).rstrip('/')}/{rel}")
    rmtree(source)


def upload_tree(local_dir: str, url: str, *, last: tuple[str, ...] = ()) -> None:
    """Copy every file under `local_dir` to `url`, the files named in `last` (relative paths)
    after all the others: a reader that waits for them sees a complete copy."""
    fs = filesystem(url)
    files = walk_files(local_dir)
    base = _key(url).rstrip("/")
    for rel in sorted(files, key=lambda r: r in last):
        fs.put_file(os.path.join(local_dir, rel), f"{base}/{rel}")
    fs.invalidate_cache(base)


def download_tree(url: str, local_dir: str) -> None:
    """Copy every object under `url` into `local_dir` (created)."""
    fs = filesystem(url)
    base = _key(url).rstrip("/")
    for rel in walk_files(url):
        target = os.path.join(local_dir, *rel.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fs.get_file(f"{base}/{rel}", target)


# Data read by libraries that open local files only (ArrayRecord's reader, the text index's
# scans): each object is copied whole to this host's disk the first time a process needs it,
# and read from there by that process, its Grain workers and later runs on the host.
DATA_CACHE_ENV = "NNX_ZOO_DATA_CACHE"


def local_copy(url: str) -> str:
    """A local file with `url`'s bytes, under $NNX_ZOO_DATA_CACHE (default
    $TMPDIR/nnx-zoo-data-cache), named by the URL and the object's size (an object written
    again under the same URL with another size gets a new copy) and keeping its file name."""
    root = os.environ.get(DATA_CACHE_ENV) or os.path.join(
        tempfile.gettempdir(), "nnx-zoo-data-cache"
    )
    object_size = size(url)
    digest = hashlib.sha256(f"{url}:{object_size}".encode()).hexdigest()[:24]
    local = os.path.join(root, digest, basename(url))
    if os.path.isfile(local) and os.path.getsize(local) == object_size:
        return local
    os.makedirs(os.path.dirname(local), exist_ok=True)
    partial = f"{local}.{os.getpid()}.{threading.get_ident()}.partial"
    with open(partial, "wb") as out, open_read(url) as f:
        while chunk := f.read(16 * 2**20):
            out.write(chunk)
    os.replace(partial, local)  # whole or absent, whichever worker finishes first
    return local


def check_writable(url: str) -> None:
    """Write and delete one object under `url`: a missing bucket, a denied write or an
    unreachable endpoint is found now, in one line (UsageError), before any work."""
    import uuid

    probe = join(url, f".write-test-{uuid.uuid4().hex}")
    try:
        write_bytes(probe, b"")
        remove(probe)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 -- any failure of the store: the URL and its message
        raise error(url, e, "be written") from None
