"""The uploads and source files of MinerU's document API (``mineru_api``), in the process's memory.

MinerU's client sends a document in three steps (mineru 4.0.12 ``MinerUApiParser._upload``):
``POST /v1/uploads`` declares it (name, size, MIME type, optional SHA-256), ``PUT`` its bytes to
the ``upload_url`` answered, ``POST /v1/uploads/{id}/complete`` makes it a file whose id a parse
job names. ``FileStore`` keeps both kinds of record, each readable only by the API key that made
it, until it expires (``ttl`` seconds after it was made, at most what the client asked) or is
deleted. A declaration whose SHA-256 and size match a live file of the same key is answered
``completed`` with that file at once, as MinerU's server does (no second copy of the bytes).

Memory is bounded, for the store and for each key: the bytes held (sent by ``PUT`` to pending
uploads, and of files, each counted once) stay under ``max_bytes`` and, for one key, under
``key_bytes``; the records under ``max_records`` and ``key_records``. A declaration costs no bytes
until its bytes arrive, and lives ``pending_ttl`` seconds until they do (then its full lifetime),
so declarations nobody sends cannot hold the store: one key filling its own quota is refused
``429 upload_quota_exceeded``, the store full ``429 upload_store_full``, both with ``Retry-After``
(space comes back as records expire or are deleted). Nothing is written to disk. The store is the
process's own: replicas behind a load balancer do not share it (one client's upload and its job
must reach one ``mineru-fast serve``).
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Literal

from mineru_fast.serve.errors import ApiError

__all__ = ["UploadStatus", "Upload", "SourceFile", "FileStore"]

UploadStatus = Literal["pending", "completed", "cancelled", "expired"]


@dataclass(eq=False)
class SourceFile:
    """A completed upload: a document a parse job may name by ``id``.

    Attributes:
        id: ``file-`` and 24 hex digits, as MinerU's server makes them.
        owner: API key name that made it (None without keys).
        filename / mime_type: as declared (never used as a path).
        data: the document's bytes.
        sha256: hex digest of ``data``.
        created_at / expires_at: Unix times (whole seconds).
    """

    id: str
    owner: str | None
    filename: str
    mime_type: str
    data: bytes = field(repr=False)
    sha256: str
    created_at: int
    expires_at: int


@dataclass(eq=False)
class Upload:
    """A declared upload (``POST /v1/uploads``).

    Attributes:
        id: ``upload_`` and 24 hex digits.
        owner: API key name that made it.
        filename / mime_type / purpose: as declared.
        size: the declared size in bytes (what ``PUT`` must send).
        sha256: the declared hex digest, if any (checked at ``complete``).
        status: ``pending`` until completed or cancelled (``expired`` once past ``expires_at``).
        data: the bytes ``PUT`` sent, until completed.
        file: the ``SourceFile`` made at completion.
        created_at / expires_at: Unix times (whole seconds); a pending upload without its bytes
            expires ``pending_ttl`` after it was declared, then at ``kept_until``.
        kept_until: when its records expire once its bytes came (the lifetime asked, capped).
    """

    id: str
    owner: str | None
    filename: str
    mime_type: str
    purpose: str
    size: int
    sha256: str | None
    created_at: int
    expires_at: int
    kept_until: int
    status: UploadStatus = "pending"
    data: bytes | None = field(default=None, repr=False)
    file: SourceFile | None = None


class FileStore:
    """Uploads and source files by id, per API key, with expiry and memory bounds; thread-safe.

    Args:
        max_bytes: most bytes held at once (sent to pending uploads, and files).
        ttl: seconds a record lives at most.
        max_records: most uploads and files kept at once.
        key_bytes: most bytes one key holds at once (default: a quarter of ``max_bytes``).
        key_records: most uploads and files one key keeps at once (default: an eighth of
            ``max_records``, at least 1).
        pending_ttl: seconds a declaration lives before its bytes arrive (capped at ``ttl``).
        clock: Unix time in seconds (injectable for tests).

    Raises:
        ValueError: a bound that is not positive.
    """

    def __init__(
        self,
        max_bytes: int,
        ttl: float,
        max_records: int = 4096,
        *,
        key_bytes: int | None = None,
        key_records: int | None = None,
        pending_ttl: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.key_bytes = max_bytes // 4 if key_bytes is None else key_bytes
        self.key_records = max(1, max_records // 8) if key_records is None else key_records
        bounds = (max_bytes, ttl, max_records, self.key_bytes, self.key_records, pending_ttl)
        if min(bounds) <= 0:
            raise ValueError("max_bytes, ttl, max_records, key_bytes, key_records and pending_ttl must be > 0")
        self.max_bytes, self.ttl, self.max_records, self.clock = max_bytes, ttl, max_records, clock
        self.pending_ttl = min(pending_ttl, ttl)
        self._uploads: dict[str, Upload] = {}
        self._files: dict[str, SourceFile] = {}
        self._lock = threading.Lock()

    # -- uploads ---------------------------------------------------------------------------------
    def create_upload(
        self,
        owner: str | None,
        filename: str,
        size: int,
        mime_type: str,
        purpose: str,
        sha256: str | None,
        lifetime: float | None = None,
    ) -> Upload:
        """Declare an upload; one whose ``sha256`` and ``size`` match a live file of ``owner``
        is completed at once with that file (its expiry renewed).

        Args:
            lifetime: seconds the client asked the records to live; capped at ``ttl``.

        Raises:
            ApiError: 429 ``upload_quota_exceeded`` when ``owner``'s records or bytes (with
                ``size`` more) would pass its quota, 429 ``upload_store_full`` when the store's
                would; both with ``Retry-After``.
        """
        with self._lock:
            now = self._expire_locked()
            kept_until = now + math.ceil(min(self.ttl, lifetime or self.ttl))
            expires = min(kept_until, now + math.ceil(self.pending_ttl))
            upload = Upload(
                _new_id("upload_"), owner, filename, mime_type, purpose, size, sha256, now, expires, kept_until
            )
            same = next(
                (f for f in self._files.values() if f.owner == owner and f.sha256 == sha256 and len(f.data) == size),
                None,
            )
            if same is not None:
                same.expires_at = max(same.expires_at, kept_until)
                upload.status, upload.file, upload.expires_at = "completed", same, kept_until
            else:
                self._check_room_locked(owner, size)
            if self._records_locked(owner) >= self.key_records:
                raise self._full_locked(owner)
            if self._records_locked() >= self.max_records:
                raise self._full_locked()
            self._uploads[upload.id] = upload
            return upload

    def get_upload(self, owner: str | None, upload_id: str) -> Upload:
        """The upload ``upload_id`` of ``owner``.

        Raises:
            ApiError: 404 ``upload_not_found`` (unknown, another key's, or expired).
        """
        with self._lock:
            self._expire_locked()
            upload = self._uploads.get(upload_id)
            if upload is None or upload.owner != owner:
                raise ApiError(404, "upload_not_found", "no such upload (unknown id, another key's, or expired)")
            return upload

    def put_content(self, owner: str | None, upload_id: str, data: bytes) -> Upload:
        """Store the bytes of a pending upload (a repeat replaces them); its records then live
        until ``kept_until``.

        Raises:
            ApiError: 404 ``upload_not_found``; 409 ``upload_already_terminal`` once completed or
                cancelled; 400 ``upload_size_mismatch`` when ``data`` is not the declared size;
                429 ``upload_quota_exceeded`` / ``upload_store_full`` when the bytes do not fit.
        """
        upload = self.get_upload(owner, upload_id)
        with self._lock:
            _require_pending(upload)
            if len(data) != upload.size:
                raise ApiError(
                    400, "upload_size_mismatch", f"the upload declared {upload.size} bytes; {len(data)} were sent"
                )
            upload.data = None  # a repeat's earlier bytes are replaced, not added
            self._check_room_locked(owner, len(data))
            upload.data, upload.expires_at = data, upload.kept_until
            return upload

    def complete(self, owner: str | None, upload_id: str, sha256: str, expected: str | None = None) -> Upload:
        """Make a pending upload's bytes a ``SourceFile``.

        Args:
            sha256: hex digest of the bytes ``put_content`` stored (the caller hashes them off
                the event loop).
            expected: a digest the completing request names, if any.

        Raises:
            ApiError: 404 ``upload_not_found``; 409 ``upload_already_terminal`` once completed or
                cancelled, ``upload_not_ready`` before the bytes came; 400 ``file_hash_mismatch``
                when a declared digest differs from the bytes'.
        """
        upload = self.get_upload(owner, upload_id)
        with self._lock:
            _require_pending(upload)
            if upload.data is None:
                raise ApiError(409, "upload_not_ready", "the upload's bytes have not been sent (PUT its upload_url)")
            for declared in (expected, upload.sha256):
                if declared is not None and declared != sha256:
                    raise ApiError(
                        400, "file_hash_mismatch", "the SHA-256 of the bytes sent differs from the one declared"
                    )
            now = int(self.clock())
            source = SourceFile(
                _new_id("file-"), owner, upload.filename, upload.mime_type, upload.data, sha256, now, upload.expires_at
            )
            self._files[source.id] = source
            upload.status, upload.data, upload.file, upload.sha256 = "completed", None, source, sha256
            return upload

    def cancel(self, owner: str | None, upload_id: str) -> Upload:
        """Cancel a pending upload (its bytes are dropped).

        Raises:
            ApiError: 404 ``upload_not_found``; 409 ``upload_already_terminal`` once completed or cancelled.
        """
        upload = self.get_upload(owner, upload_id)
        with self._lock:
            _require_pending(upload)
            upload.status, upload.data = "cancelled", None
            return upload

    # -- files -----------------------------------------------------------------------------------
    def get_file(self, owner: str | None, file_id: str) -> SourceFile:
        """The source file ``file_id`` of ``owner``.

        Raises:
            ApiError: 404 ``file_not_found`` (unknown, another key's, expired or deleted).
        """
        with self._lock:
            self._expire_locked()
            source = self._files.get(file_id)
            if source is None or source.owner != owner:
                raise ApiError(404, "file_not_found", "no such file (unknown id, another key's, expired or deleted)")
            return source

    def delete_file(self, owner: str | None, file_id: str) -> None:
        """Forget a source file (jobs already queued from it keep their copy).

        Raises:
            ApiError: 404 ``file_not_found``.
        """
        source = self.get_file(owner, file_id)
        with self._lock:
            self._files.pop(source.id, None)

    # -- bounds ----------------------------------------------------------------------------------
    def held_bytes(self, owner: str | None | EllipsisType = ...) -> int:
        """Bytes held now (sent to pending uploads, and files): the store's (``...``), or ``owner``'s."""
        with self._lock:
            self._expire_locked()
            return self._held_locked(owner)

    def records(self) -> int:
        """Uploads and files kept now (expired ones dropped first)."""
        with self._lock:
            self._expire_locked()
            return self._records_locked()

    def _owned(self, owner: str | None | EllipsisType) -> tuple[list[Upload], list[SourceFile]]:
        """The uploads and files of ``owner`` (all of them for ``...``)."""
        uploads, files = list(self._uploads.values()), list(self._files.values())
        if owner is ...:
            return uploads, files
        return [u for u in uploads if u.owner == owner], [f for f in files if f.owner == owner]

    def _held_locked(self, owner: str | None | EllipsisType = ...) -> int:
        uploads, files = self._owned(owner)
        sent = sum(len(u.data) for u in uploads if u.status == "pending" and u.data is not None)
        return sent + sum(len(f.data) for f in files)

    def _records_locked(self, owner: str | None | EllipsisType = ...) -> int:
        uploads, files = self._owned(owner)
        return len(uploads) + len(files)

    def _check_room_locked(self, owner: str | None, size: int) -> None:
        if self._held_locked(owner) + size > self.key_bytes:
            raise self._full_locked(owner)
        if self._held_locked() + size > self.max_bytes:
            raise self._full_locked()

    def _full_locked(self, owner: str | None | EllipsisType = ...) -> ApiError:
        """429 for the store (``...``) or for ``owner``'s quota, ``Retry-After`` the first expiry among them."""
        uploads, files = self._owned(owner)
        now = int(self.clock())
        retry = max(1, min([u.expires_at for u in uploads] + [f.expires_at for f in files], default=now + 1) - now)
        headers = {"Retry-After": str(retry)}
        if owner is not ...:
            return ApiError(
                429,
                "upload_quota_exceeded",
                f"this API key holds as many uploads as one key may (records or bytes); retry in {retry} s, or "
                "delete its files (DELETE /v1/files/{id})",
                headers,
            )
        return ApiError(
            429,
            "upload_store_full",
            f"the server holds as many uploads as it keeps; retry in {retry} s, or delete files "
            "(DELETE /v1/files/{id})",
            headers,
        )

    def _expire_locked(self) -> int:
        """Drop what has expired; returns now (whole seconds)."""
        now = int(self.clock())
        for upload_id, upload in list(self._uploads.items()):
            if upload.expires_at <= now:
                del self._uploads[upload_id]
        for file_id, source in list(self._files.items()):
            if source.expires_at <= now:
                del self._files[file_id]
        return now


def _require_pending(upload: Upload) -> None:
    if upload.status != "pending":
        raise ApiError(409, "upload_already_terminal", f"the upload is {upload.status}")


def _new_id(prefix: str) -> str:
    """An id as MinerU's server makes them: a prefix and 24 random hex digits."""
    return prefix + secrets.token_hex(12)
