"""A Delta warehouse in an object store: S3 (or an S3-compatible server), GCS, Azure, through obstore.

The URL names the bucket and the warehouse's prefix in it (s3://bucket/warehouse). Credentials
come from the environment as the provider's own tools read them: AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN (or a container or instance role); GOOGLE_* ; AZURE_*.
For S3, AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) names an S3-compatible server, an http://
one included (replicator.s3_endpoint), and AWS_REGION the region.

put_if_absent is a conditional PUT (If-None-Match: *), which S3, GCS and Azure honour; a file
written by open_write is a (multipart) upload completed when the block ends, aborted when it
raises, so no reader ever sees part of one. Opening the storage lists the warehouse's root once,
so that a missing bucket, refused credentials or an unreachable endpoint are told at once, in
one line, with what to change.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any, NoReturn, cast

import obstore
from obstore.exceptions import AlreadyExistsError, BaseError, PermissionDeniedError, UnauthenticatedError
from obstore.store import from_url

from replicator.errors import UserError, first_line
from replicator.s3_endpoint import s3_endpoint
from replicator.targets.delta.storage import Entry, inside

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer
    from obstore import ReadableFile, WritableFile

# URL scheme → provider, as obstore.store.from_url reads them
PROVIDERS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "az": "azure", "azure": "azure", "abfs": "azure",
             "abfss": "azure", "adl": "azure"}
CREDENTIALS = {"s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (AWS_SESSION_TOKEN)",
               "gcs": "GOOGLE_SERVICE_ACCOUNT or GOOGLE_APPLICATION_CREDENTIALS",
               "azure": "AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY (or AZURE_CLIENT_ID...)"}
SCHEME_ALIASES = {"s3": ("s3", "s3a"), "s3a": ("s3", "s3a")}   # Spark's writers name S3 files s3a://
MISSING_BUCKET = {"NoSuchBucket", "ContainerNotFound"}
DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
          "AuthorizationHeaderMalformed", "AuthenticationFailed", "AuthorizationFailure"}
_CODE = re.compile(r"<Code>([^<]+)</Code>")
_UNREACHABLE = ("error sending request", "dns error", "connection refused", "timed out", "tcp connect error")


class ObjectStorage:
    """A warehouse at an object-store URL (the Storage protocol of replicator.targets.delta.storage)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        scheme, _, rest = self.url.partition("://")
        provider = PROVIDERS.get(scheme.lower())
        if provider is None:
            raise UserError(f"{url}: not a warehouse URL: use a local path, s3://, gs://, az:// or abfss://")
        self._bucket = rest.split("/", 1)[0]
        if not self._bucket:
            raise UserError(f"{url}: the URL names no bucket: use {scheme}://BUCKET/PATH")
        self._provider = provider
        aliases = SCHEME_ALIASES.get(scheme.lower(), (scheme,))
        self.roots: tuple[str, ...] = tuple(f"{alias}://{rest}" for alias in aliases)
        self._endpoint = s3_endpoint() if provider == "s3" else None
        options: dict[str, Any] = {}
        if self._endpoint and self._endpoint.url:
            options["config"] = {"endpoint": self._endpoint.url, "region": self._endpoint.region}
            options["client_options"] = {"allow_http": self._endpoint.plain_http}
        try:
            self._store = from_url(self.url, **options)
        except (BaseError, ValueError) as exc:   # a malformed URL or configuration value
            raise UserError(f"{url}: {first_line(exc)}") from None
        with self._errors():
            obstore.list_with_delimiter(self._store, None)

    def read(self, path: str) -> bytes:
        inside(self.url, path)
        with self._errors(path):
            return bytes(obstore.get(self._store, path).bytes())

    def exists(self, path: str) -> bool:
        inside(self.url, path)
        try:
            with self._errors(path):
                obstore.head(self._store, path)
        except FileNotFoundError:
            return False
        return True

    def write(self, path: str, data: bytes) -> None:
        inside(self.url, path)
        with self._errors(path):
            obstore.put(self._store, path, data)

    def put_if_absent(self, path: str, data: bytes) -> bool:
        inside(self.url, path)
        try:
            with self._errors(path):
                obstore.put(self._store, path, data, mode="create")
        except AlreadyExistsError:
            return False
        return True

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[IO[bytes]]:
        inside(self.url, path)
        with self._errors(path):
            upload = obstore.open_writer(self._store, path)
        try:
            yield cast("IO[bytes]", _Writer(upload, self, path))
        except BaseException as exc:
            upload.__exit__(type(exc), exc, exc.__traceback__)   # aborts the upload
            raise
        with self._errors(path):
            upload.close()   # completes it: the file appears whole

    def open_read(self, path: str) -> IO[bytes]:
        inside(self.url, path)
        with self._errors(path):
            reader = obstore.open_reader(self._store, path)
        return cast("IO[bytes]", _Reader(reader, self, path))

    def list(self, prefix: str) -> list[Entry]:
        entries: list[Entry] = []
        prefix = inside(self.url, prefix.rstrip("/"))
        with self._errors(prefix):
            for chunk in obstore.list(self._store, prefix or None):
                entries.extend(Entry(meta["path"], meta["size"], meta["last_modified"].timestamp())
                               for meta in chunk)
        return entries

    def delete(self, path: str) -> None:
        inside(self.url, path)
        with self._errors(path):
            obstore.delete(self._store, path)   # no error for a missing object

    def delta_rs(self) -> tuple[str, dict[str, str]]:
        """delta-rs reads credentials from the environment as obstore does; the endpoint, region
        and plain HTTP are passed as obstore was given them."""
        if not (self._endpoint and self._endpoint.url):
            return self.url, {}
        options = {"AWS_ENDPOINT_URL": self._endpoint.url, "AWS_ALLOW_HTTP": str(self._endpoint.plain_http).lower()}
        if self._endpoint.region:
            options["AWS_REGION"] = self._endpoint.region
        return self.url, options

    @contextlib.contextmanager
    def _errors(self, path: str | None = None) -> Iterator[None]:
        """The store's errors a user can fix as one-line UserErrors; a missing object stays a
        FileNotFoundError, an existing one (mode="create") an AlreadyExistsError."""
        try:
            yield
        except AlreadyExistsError:
            raise
        except (BaseError, FileNotFoundError) as exc:
            self._raise(exc, path)

    def _raise(self, exc: Exception, path: str | None) -> NoReturn:
        text = str(exc)
        code = match.group(1) if (match := _CODE.search(text)) else None
        where = f" at {self._endpoint.url}" if self._endpoint and self._endpoint.url else ""
        if code in MISSING_BUCKET:
            raise UserError(f"{self.url}: the bucket {self._bucket!r} does not exist{where}: "
                            "create it, or correct the warehouse URL") from None
        if code in DENIED or isinstance(exc, (PermissionDeniedError, UnauthenticatedError)):
            raise UserError(f"{self.url}: access denied ({code or type(exc).__name__}){where}: "
                            f"check the credentials in {CREDENTIALS[self._provider]}") from None
        if isinstance(exc, FileNotFoundError):
            raise FileNotFoundError(f"{self.url}/{path}: no such file") from None
        if any(sign in text.lower() for sign in _UNREACHABLE):
            setting = " (AWS_ENDPOINT_URL)" if where else ""
            raise UserError(f"{self.url}: cannot reach the object store{where}: check the endpoint{setting}, "
                            "and that the server runs") from None
        raise UserError(f"{self.url}: {first_line(exc)}") from None


class _Writer(io.RawIOBase):
    """obstore's upload as a Python binary file (pyarrow wants `closed` and `writable`), unbuffered
    (obstore buffers the parts); closing it leaves the upload to open_write to end."""

    def __init__(self, upload: WritableFile, storage: ObjectStorage, path: str) -> None:
        self._upload, self._storage, self._path = upload, storage, path

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer) -> int:
        with self._storage._errors(self._path):
            return self._upload.write(data)


class _Reader(io.RawIOBase):
    """obstore's buffered ranged reader as a seekable Python binary file, for
    pyarrow.parquet.ParquetFile (which reads the footer, then the column chunks it needs)."""

    def __init__(self, reader: ReadableFile, storage: ObjectStorage, path: str) -> None:
        self._reader, self._storage, self._path = reader, storage, path

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        with self._storage._errors(self._path):
            data = self._reader.read(len(view))
        view[:len(data)] = memoryview(data)
        return len(data)

    def read(self, size: int | None = -1) -> bytes:
        with self._storage._errors(self._path):
            data = self._reader.readall() if size is None or size < 0 else self._reader.read(size)
        return bytes(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._reader.seek(offset, whence)

    def tell(self) -> int:
        return self._reader.tell()

    def close(self) -> None:
        if not self.closed:
            self._reader.close()
        super().close()
