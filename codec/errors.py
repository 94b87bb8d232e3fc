"""Codec errors, typed by whose fault they are and what goes on the wire.

Like h11's ``LocalProtocolError``/``RemoteProtocolError``: a ``RemoteProtocolError``
means the peer sent something we cannot accept; it carries the status a server
answers with (``status``) and whether the connection can stay in sync
(``recoverable``: the framing is still known, so the rest of the request can be
drained and one well-formed response written). A ``LocalProtocolError`` means our
own code asked the codec to encode something illegal.
"""
from __future__ import annotations

from .enums import Status


class CodecError(Exception):
    """Root of every error the codec raises. Garbage input never raises anything else."""

    status: Status = Status.ERROR

    def __init__(self, message: str, *, status: Status | None = None, rule: str | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status
        # A short stable identifier of the rule that failed (e.g. "v3.hdr_len"), for
        # tests, metrics and the fuzzer's finding classes.
        self.rule = rule or type(self).__name__


class LocalProtocolError(CodecError):
    """We tried to encode something the wire format cannot carry."""


class RemoteProtocolError(CodecError):
    """The peer sent bytes that violate the protocol."""

    recoverable = True


class BadMagic(RemoteProtocolError):
    """The first two bytes of a request are not ``59 48``: not Hydra, close without reply."""

    recoverable = False


class FrameTooLarge(RemoteProtocolError):
    """A length field exceeds a configured limit. Checked before anything is allocated."""

    status = Status.ERROR


class MalformedPayload(RemoteProtocolError):
    """The framing is fine but a payload does not parse."""

    status = Status.BAD_REQUEST


class Truncated(RemoteProtocolError):
    """The input ended before a structure was complete."""

    status = Status.BAD_REQUEST
