"""The captured part of one Hydra payload (:class:`Payload`) and the helpers every payload
decoder of ``hydra_payloads`` uses: a failed decode's note, a JSON body as a field."""
from __future__ import annotations

from codec import payloads as P
from codec.errors import CodecError

from .model import ERROR, NOTE, WARN, Field, Message
from .util import compact, human, text


class Payload:
    """The captured part of one payload and where it sits in its message."""

    def __init__(self, msg: Message, buf: bytes, base: int, total: int):
        self.msg, self.buf, self.base, self.total = msg, buf, base, total

    @property
    def whole(self) -> bool:
        return len(self.buf) == self.total

    def need_whole(self, what: str) -> bool:
        if not self.whole:
            self.msg.note(f"{what}: only {human(len(self.buf))} of {human(self.total)} captured; not decoded", NOTE)
        return self.whole

    def raw(self, parent: Field | Message, name: str = "hydra.payload.raw") -> Field:
        return parent.add(name, self.buf[:64], self.base, self.total,
                          show=f"{human(self.total)}: {self.buf[:32].hex(' ')}{' …' if self.total > 32 else ''}")


def fail(msg: Message, what: str, e: Exception, severity: str = ERROR) -> None:
    rule = getattr(e, "rule", None)
    msg.note(f"{what}: {e}" + (f" [rule {rule}]" if rule else ""), severity)


def json_field(pl: Payload, parent: Field | Message, name: str, data: bytes, offset: int,
               length: int | None = None) -> Field:
    length = len(data) if length is None else length
    try:
        obj = P.loads_json(data, "inspect.json")
    except CodecError as e:
        fail(pl.msg, f"{name} is not valid JSON", e, WARN)
        return parent.add(name, text(data[:200]), offset, length, show=f"(invalid JSON) {text(data[:80])!r}")
    return parent.add(name, obj, offset, length, show=compact(obj))
