"""moto's S3 server with its object writes made atomic, as S3's are: moto checks a conditional
write's condition (If-None-Match: *, If-Match) and then writes, on the server's request threads,
with nothing between them, so two writers racing for one key could both be told they created it.
One lock around each write makes the check and the write one step; what decides the race is still
the condition replicator sends. Started by s3_helpers.MotoServer, with moto_server's arguments."""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

from moto.s3.responses import S3Response
from moto.server import main

_writes = threading.Lock()


def _atomic(write: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(write)
    def atomically(*args: Any, **kwargs: Any) -> Any:
        with _writes:
            return write(*args, **kwargs)
    return atomically


S3Response.put_object = _atomic(S3Response.put_object)                  # type: ignore[method-assign]
S3Response._key_response_post = _atomic(S3Response._key_response_post)  # type: ignore[method-assign]  # completes multipart uploads

if __name__ == "__main__":
    sys.exit(main())
