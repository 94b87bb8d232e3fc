"""HTTP/1.1 on the wire, against a real server process: what any HTTP side of ours must do,
whatever serves it. The client is a plain loopback socket (no HTTP library), so framing,
keep-alive, pipelining, closes and refusals are checked byte by byte.

Only what a client relies on is pinned: status codes, how each message is framed, whether the
connection stays open, and the JSON error object ``{"error": {"message", "type", "param",
"code"}}`` of the routes' own refusals — not error wording, header order, or the body of a
refusal made before any route ran (a request the parser cannot read).

Every read has a socket timeout: it only turns a hang into a failure, no test waits on the
clock. Blocking sockets, so the tests are synchronous; pytest-timeout bounds each one.
"""
from __future__ import annotations

import json
import select
import socket
from dataclasses import dataclass

import pytest

from tests.helpers import wait_until

MAX_BODY = 64 << 10  # the JSON body limit of this module's server (HYDRA_HTTP_MAX_BODY)
SERVER_ARGS = ("--model", "tiny", "--log-level", "WARNING")
SERVER_ENV = {"HYDRA_HTTP_MAX_BODY": str(MAX_BODY)}
READ_TIMEOUT = 15.0  # a safety net: an answer that does not come fails the test instead of hanging it

pytestmark = pytest.mark.timeout(60)

TOKENIZE_BODY = json.dumps({"content": "hello wire world"}).encode()


# ---------------------------------------------------------------- a tiny HTTP/1.1 client
@dataclass
class Response:
    version: bytes
    status: int
    headers: list[tuple[str, str]]  # names lowercased, in the order received
    body: bytes
    framing: str  # "length", "chunked", "close" or "none" (HEAD, 1xx, 204, 304)

    def header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k == name.lower()]
        return ", ".join(values) if values else None

    def tokens(self, name: str) -> set[str]:
        """A comma-separated header's tokens, lowercased (``Connection``, ``Allow``, …)."""
        return {t.strip().lower() for t in (self.header(name) or "").split(",") if t.strip()}

    @property
    def closes(self) -> bool:
        return "close" in self.tokens("connection")

    def json(self):
        return json.loads(self.body)


class Closed(Exception):
    """The server closed the connection (FIN or reset) where more bytes were expected."""


class Conn:
    """One loopback connection with a read buffer; ``response()`` reads one framed response."""

    def __init__(self, port: int, timeout: float = READ_TIMEOUT):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""

    def __enter__(self) -> "Conn":
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def try_send(self, data: bytes) -> bool:
        """Send, unless the server already closed (it may, after refusing a request)."""
        try:
            self.sock.sendall(data)
            return True
        except (BrokenPipeError, ConnectionResetError):
            return False

    def readable(self) -> bool:
        """Bytes (or a close) are waiting right now: no waiting here."""
        return bool(self.buf) or bool(select.select([self.sock], [], [], 0)[0])

    def _fill(self) -> None:
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            data = b""
        if not data:
            raise Closed(self.buf)
        self.buf += data

    def _until(self, sep: bytes) -> bytes:
        while (i := self.buf.find(sep)) < 0:
            self._fill()
        out, self.buf = self.buf[:i], self.buf[i + len(sep):]
        return out

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def response(self, head: bool = False) -> Response:
        """The next response (``head``: the answer to a HEAD, whose framing headers carry no body)."""
        status_line, *lines = self._until(b"\r\n\r\n").split(b"\r\n")
        version, status, *_ = status_line.split(b" ", 2)
        assert version in (b"HTTP/1.1", b"HTTP/1.0"), status_line
        headers = []
        for line in lines:
            name, sep, value = line.partition(b":")
            assert sep and name and name == name.strip(), line
            headers.append((name.decode("latin-1").lower(), value.strip().decode("latin-1")))
        r = Response(version, int(status), headers, b"", "none")
        if head or 100 <= r.status < 200 or r.status in (204, 304):
            return r
        if "chunked" in r.tokens("transfer-encoding"):
            assert r.header("content-length") is None, r.headers  # never both
            r.framing, r.body = "chunked", self._chunked()
        elif (length := r.header("content-length")) is not None:
            assert length.isdigit(), length
            r.framing, r.body = "length", self._exactly(int(length))
        else:
            r.framing, r.body = "close", self.rest()
        return r

    def _chunked(self) -> bytes:
        body = b""
        while True:
            size = int(self._until(b"\r\n").split(b";")[0].strip(), 16)
            if size == 0:
                while self._until(b"\r\n"):  # trailers, up to the empty line
                    pass
                return body
            body += self._exactly(size)
            assert self._exactly(2) == b"\r\n"

    def rest(self) -> bytes:
        """Everything until the server closes (FIN or reset)."""
        try:
            while True:
                self._fill()
        except Closed:
            out, self.buf = self.buf, b""
            return out

    def assert_closed(self) -> None:
        """The server closes the connection next, with no stray bytes after its last response."""
        assert self.rest() == b""


def request(method: str, path: str, body: bytes | None = None, *, version: str = "HTTP/1.1",
            headers: dict[str, str] | None = None) -> bytes:
    head = [f"{method} {path} {version}", "Host: 127.0.0.1"]
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + (body or b"")


def chunked(body: bytes, pieces: int = 3) -> list[bytes]:
    """``body`` as ``pieces`` chunks and the last chunk, one ``bytes`` each."""
    step = -(-len(body) // pieces)
    parts = [body[i:i + step] for i in range(0, len(body), step)]
    return [b"%x\r\n%s\r\n" % (len(p), p) for p in parts] + [b"0\r\n\r\n"]


def assert_error_object(r: Response, status: int) -> dict:
    assert r.status == status, (r.status, r.body)
    assert (r.header("content-type") or "").split(";")[0].strip() == "application/json", r.headers
    err = r.json()["error"]
    assert {"message", "type", "param", "code"} <= err.keys(), err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["code"] == status
    return err


def get(port: int, path: str = "/health") -> Response:
    with Conn(port) as c:
        c.send(request("GET", path, headers={"Connection": "close"}))
        return c.response()


def assert_healthy(port: int) -> None:
    """A new connection is answered (the server survived what the test did)."""
    assert get(port).status == 200


# ---------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def port(server) -> int:
    """The module server's HTTP port, once /health says the model is ready (200)."""
    wait_until(lambda: get(server.http_port).status == 200, "the server to be ready", timeout=60)
    return server.http_port


@pytest.fixture(scope="module")
def tokens(port) -> list[int]:
    """What POST /tokenize answers for TOKENIZE_BODY, sent plainly with a Content-Length."""
    with Conn(port) as c:
        c.send(request("POST", "/tokenize", TOKENIZE_BODY))
        r = c.response()
    assert r.status == 200, r.body
    assert r.json()["tokens"]
    return r.json()["tokens"]


# ---------------------------------------------------------------- persistent connections
def test_keep_alive_answers_two_requests_on_one_connection(port):
    with Conn(port) as c:
        for _ in range(2):
            c.send(request("GET", "/health"))
            r = c.response()
            assert r.status == 200 and r.version == b"HTTP/1.1" and not r.closes
            assert r.json()["status"] == "ok"
        assert not c.readable()  # nothing more came, and the connection was not closed


@pytest.mark.parametrize("n", [2, 3])
def test_pipelined_requests_are_answered_in_order(port, n, tokens):
    reqs = [(request("GET", "/version"), lambda b: "version" in b),
            (request("POST", "/tokenize", TOKENIZE_BODY), lambda b: b.get("tokens") == tokens),
            (request("GET", "/health"), lambda b: b.get("status") == "ok")][-n:]
    with Conn(port) as c:
        c.send(b"".join(req for req, _ in reqs))  # one send: the server finds them all in its buffer
        for i, (_, expected) in enumerate(reqs):
            r = c.response()
            assert r.status == 200 and r.framing in ("length", "chunked") and not r.closes, (i, r)
            assert expected(r.json()), (i, r.body)
        c.send(request("GET", "/health"))
        assert c.response().status == 200


def test_http_1_0_without_keep_alive_is_answered_then_closed(port):
    with Conn(port) as c:
        c.send(b"GET /health HTTP/1.0\r\n\r\n")
        r = c.response()
        assert r.status == 200 and r.json()["status"] == "ok"
        c.assert_closed()


def test_connection_close_is_answered_then_closed(port):
    with Conn(port) as c:
        c.send(request("GET", "/health", headers={"Connection": "close"}))
        r = c.response()
        assert r.status == 200 and r.version == b"HTTP/1.1" and r.closes
        c.assert_closed()


def test_head_has_the_headers_and_no_body(port):
    with Conn(port) as c:
        c.send(request("HEAD", "/health"))
        r = c.response(head=True)
        assert r.status == 200 and not r.closes
        assert r.header("content-type").startswith("application/json")
        # a HEAD answer's body bytes would show up ahead of this one
        c.send(request("GET", "/health"))
        r = c.response()
        assert r.status == 200 and r.json()["status"] == "ok"


# ---------------------------------------------------------------- the routes' own refusals
@pytest.mark.parametrize("method, path, body, status", [
    ("GET", "/no/such/route", None, 404),
    ("POST", "/no/such/route", b'{"a": 1}', 404),
    ("DELETE", "/health", None, 405),
    ("POST", "/health", b'{"a": 1}', 405),  # its body is read and dropped, never taken as a request
    ("GET", "/tokenize", None, 405),
])
def test_unknown_path_or_method_is_a_json_error_and_the_connection_stays(port, method, path, body, status):
    with Conn(port) as c:
        c.send(request(method, path, body))
        r = c.response()
        assert_error_object(r, status)
        assert not r.closes
        if status == 405:
            allowed = r.tokens("allow")
            assert allowed and method.lower() not in allowed, r.headers
            assert ("post" if path == "/tokenize" else "get") in allowed
        c.send(request("GET", "/health"))
        assert c.response().status == 200


# ---------------------------------------------------------------- unreadable requests
def refused(port: int, data: bytes, statuses: tuple[int, ...]) -> None:
    """``data`` is refused: an answer with one of ``statuses`` (when one comes), then a close."""
    with Conn(port) as c:
        c.try_send(data)
        try:
            r = c.response()
        except Closed as e:  # closed without an answer: allowed, as long as it closes
            assert e.args[0] == b"", e.args[0]
        else:
            assert r.status in statuses, (r.status, r.body)
            c.assert_closed()
    assert_healthy(port)


@pytest.mark.parametrize("data", [
    b"HELLO\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(32)) + b"\r\n\r\n",  # a TLS hello
    b"GET /health FOO/1.1\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/1.1 extra\r\nHost: x\r\n\r\n",
    b"GET /hea\x00lth HTTP/1.1\r\nHost: x\r\n\r\n",
], ids=["garbage", "tls", "not-http", "http-9.9", "extra-token", "nul-in-path"])
def test_a_malformed_request_line_is_a_400_and_a_close(port, data):
    refused(port, data, (400,))


@pytest.mark.parametrize("version", ["HTTP/2.0", "HTTP/0.9"])
def test_a_request_line_in_another_major_version_is_answered_in_http_1(port, version):
    """Refused (400, 505) or served as HTTP/1.x, but never a status line in the version the
    request line claimed (Conn.response() insists on HTTP/1.0 or HTTP/1.1); a close after it."""
    refused(port, f"GET /health {version}\r\nHost: x\r\nConnection: close\r\n\r\n".encode(), (200, 400, 505))


@pytest.mark.parametrize("what", ["long-line", "many-headers"])
def test_oversized_headers_are_refused_and_closed(port, what):
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n"
    if what == "long-line":
        head += b"X-Long: " + b"a" * (65 << 10) + b"\r\n"
    else:
        head += b"".join(b"X-H-%d: v\r\n" % i for i in range(1200))
    refused(port, head + b"\r\n", (400, 431))


# ---------------------------------------------------------------- request bodies
def test_a_chunked_body_is_read_as_its_content_length_twin(port, tokens):
    with Conn(port) as c:
        c.send(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
        for piece in chunked(TOKENIZE_BODY, 4):  # one send each
            c.send(piece)
        r = c.response()
        assert r.status == 200 and r.json()["tokens"] == tokens
        c.send(request("POST", "/tokenize", TOKENIZE_BODY))  # and the connection is still in step
        assert c.response().json()["tokens"] == tokens


@pytest.mark.parametrize("framing", [
    b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
    b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
    b"Content-Length: 2\r\nContent-Length: 30\r\n",
    b"Content-Length: abc\r\n",
    b"Content-Length: -1\r\n",
    b"Content-Length: 1e3\r\n",
], ids=["cl-then-te", "te-then-cl", "two-lengths", "non-numeric", "negative", "exponent"])
def test_ambiguous_or_invalid_body_framing_is_a_400_and_a_close(port, framing):
    # the request-smuggling guard: a body whose end two parsers could disagree on is refused
    data = (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + framing + b"\r\n"
            + b"2\r\n{}\r\n0\r\n\r\n" + request("GET", "/version"))
    refused(port, data, (400,))


def test_expect_100_continue_gets_the_go_ahead_before_the_body(port, tokens):
    with Conn(port) as c:
        head = request("POST", "/tokenize", TOKENIZE_BODY, headers={"Expect": "100-continue"})
        c.send(head[:-len(TOKENIZE_BODY)])  # the headers alone
        interim = c.response()
        assert interim.status == 100 and interim.version == b"HTTP/1.1"
        c.send(TOKENIZE_BODY)
        r = c.response()
        assert r.status == 200 and r.json()["tokens"] == tokens
        c.send(request("GET", "/health"))
        assert c.response().status == 200


def test_a_declared_length_over_the_limit_is_refused_without_reading_it(port):
    with Conn(port) as c:
        length = MAX_BODY * 4
        c.send(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % length)  # and no body: the answer must not wait for it
        assert_error_object(c.response(), 413)
    assert_healthy(port)


def test_a_refused_body_is_never_taken_for_requests(port):
    """After a 413 the server drops the body it refused (or closes): requests hidden in it are
    not answered."""
    hidden = request("GET", "/version") * 4
    body = (hidden + b" " * MAX_BODY)[:MAX_BODY + 1]
    with Conn(port) as c:
        c.send(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body))
        assert_error_object(c.response(), 413)
        if c.try_send(body) and c.try_send(request("GET", "/health", headers={"Connection": "close"})):
            try:
                r = c.response()
            except Closed as e:
                assert e.args[0] == b""
            else:
                assert r.status == 200 and r.json()["status"] == "ok", r.body  # /health's, not /version's
                c.assert_closed()
    assert_healthy(port)


def test_a_chunked_body_growing_past_the_limit_is_a_413(port):
    with Conn(port) as c:
        c.send(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
        piece = b"%x\r\n%s\r\n" % (8192, b" " * 8192)
        sent = 0
        # send until the server answers (it must, once past the limit) or closes, at most 4× the limit
        while not c.readable() and sent < 4 * MAX_BODY:
            if not c.try_send(piece):
                break
            sent += 8192
        try:
            r = c.response()
        except Closed as e:
            pytest.fail(f"closed without a 413 after {sent} body bytes: {e.args[0]!r}")
        assert_error_object(r, 413)
    assert_healthy(port)


def test_a_chunked_body_that_breaks_off_mid_request_is_a_400_and_a_close(port):
    """A bad chunk size after a good chunk: the request already went to its handler, which
    answers the error (not a silent close), and nothing after it is read."""
    with Conn(port) as c:
        c.send(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n" + chunked(TOKENIZE_BODY)[0])
        c.send(b"zz\r\n" + request("GET", "/health"))
        assert_error_object(c.response(), 400)
        c.assert_closed()
    assert_healthy(port)


# ---------------------------------------------------------------- a token stream
def test_a_stream_is_framed_server_sent_events_then_the_connection_goes_on(port):
    body = json.dumps({"prompt": "hello", "max_tokens": 4, "temperature": 0, "stream": True}).encode()
    with Conn(port, timeout=30) as c:
        c.send(request("POST", "/v1/completions", body))
        r = c.response()
        assert r.status == 200, r.body
        assert r.header("content-type").split(";")[0].strip() == "text/event-stream"
        assert r.framing in ("chunked", "close")
        text = r.body.decode()
        assert text.endswith("\n\n"), text[-200:]
        events = text[:-2].split("\n\n")
        assert all(e.startswith("data: ") for e in events), events
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert chunks and all(ch["object"] == "text_completion" for ch in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] is not None  # the last one ends it
        if r.framing == "chunked":  # a framed stream leaves the connection usable
            assert not r.closes
            c.send(request("GET", "/health"))
            assert c.response().status == 200
        else:
            assert c.rest() == b""


# ---------------------------------------------------------------- paths and queries
@pytest.mark.parametrize("path", ["/slots/0/state/meta", "/slots/%30/state/meta", "/%68ealth",
                                  "/slots/%2F0/state/meta", "/health%00"])
def test_percent_encoded_paths_get_a_well_formed_answer(port, path):
    with Conn(port) as c:
        c.send(request("GET", path))
        r = c.response()
        assert r.status < 500 and r.header("content-type").startswith("application/json"), (r.status, r.body)
        body = r.json()
        if r.status == 200 and "/slots/" in path:
            assert body["slot_id"] == 0
        elif r.status >= 400:
            assert_error_object(r, r.status)
        c.send(request("GET", "/health"))
        assert c.response().status == 200


@pytest.mark.parametrize("query", ["?", "?x=1", "?x=1&y=%20&z", "?status=down"])
def test_a_query_string_on_health_is_ignored(port, query):
    with Conn(port) as c:
        c.send(request("GET", "/health" + query))
        r = c.response()
        assert r.status == 200 and r.json()["status"] == "ok"


# ---------------------------------------------------------------- clients that give up
@pytest.mark.parametrize("sent", [b"GET /hea", b"GET /health HTTP/1.1\r\nHost: x\r\n",
                                  b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{}"],
                         ids=["half-line", "half-headers", "half-body"])
@pytest.mark.parametrize("how", ["close", "shutdown"])
def test_a_client_that_gives_up_mid_request_leaves_the_server_healthy(port, sent, how):
    with Conn(port) as c:
        c.send(sent)
        if how == "shutdown":  # its half of the connection ends: the server closes its own
            c.sock.shutdown(socket.SHUT_WR)
            try:
                r = c.response()
            except Closed as e:
                assert e.args[0] == b""
            else:
                assert 400 <= r.status < 500, r.status
                c.assert_closed()
    assert_healthy(port)


def test_a_flood_of_pipelined_requests_is_answered_in_order_or_cut_with_a_429(port):
    """Ten thousand requests in one send: a read that holds more than a few dozen is refused
    (429 and a close) before its requests are made; requests read a few at a time are all
    answered. Either way each answer is whole, and the server goes on."""
    n = 10_000
    one = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with Conn(port) as c:
        c.try_send(one * (n - 1) + request("GET", "/health", headers={"Connection": "close"}))
        statuses = []
        try:
            while True:
                statuses.append(c.response().status)
        except Closed:
            pass
    assert statuses and set(statuses) <= {200, 429}, set(statuses)
    assert statuses == [200] * n or (statuses[-1] == 429 and statuses.count(429) == 1), statuses[-3:]
    assert_healthy(port)
