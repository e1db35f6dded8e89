"""A scripted OpenAI-compatible chat-completions server for the judge tests (127.0.0.1 only).

    python -m tests.judge_server PORT

The reply depends on a marker in the last user message: [good] -> "Score: 1", [bad] -> "Score: 0",
[garble] -> a reply without a score, [json] -> a JSON object, [fail] -> HTTP 500, [flaky] -> HTTP 503 the
first time, then "Score: 1", [limited] -> HTTP 429 with `Retry-After: 1` the first time, then "Score: 1",
[farday] -> HTTP 503 with a `Retry-After` date past any datetime the first time, then "Score: 1",
[nan] / [inf] -> {"score": NaN} / {"score": Infinity} (what Python's json writes and reads); hostile ones:
[huge] -> a score of 400 digits, [parts] -> the content as a list of text parts, [number] -> the content a
number, [deep] -> a score nested 100000 lists deep, [trickle] -> a body sent a byte every 0.2 s, [gzip] -> a
body marked `Content-Encoding: gzip` that is not. GET /stats ->
the requests seen, per marker, the most in flight at once, each request's message roles, when each
request came (per marker, seconds since the server started) and whether it carried an Authorization.
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
STATS: dict = {"requests": 0, "by_marker": {}, "inflight": 0, "peak": 0, "bodies": [], "roles": [], "times": {},
               "auth": []}
REPLIES = {"good": "The answer is right.\nScore: 1", "bad": "Wrong.\nScore: 0", "garble": "I refuse to grade this.",
           "json": '{"score": 0.5, "why": "partly right"}', "flaky": "Score: 1", "limited": "Score: 1",
           "farday": "Score: 1",
           "nan": '{"score": NaN}', "inf": '{"score": Infinity}', "huge": '{"score": 1' + "0" * 400 + "}",
           "parts": [{"type": "text", "text": '{"score": '}, {"type": "text", "text": "1}"}], "number": 1,
           "deep": '{"score": ' + "[" * 100_000 + "]" * 100_000 + "}", "trickle": '{"score": 1}'}
T0 = time.monotonic()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _send(self, code: int, body: str, headers: dict[str, str] | None = None) -> None:
        data = body.encode()
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        with LOCK:
            self._send(200, json.dumps(STATS))

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][-1]["content"]
        marker = (re.search(r"\[(\w+)\]", prompt) or [None, "none"])[1]
        with LOCK:
            STATS["requests"] += 1
            seen = STATS["by_marker"][marker] = STATS["by_marker"].get(marker, 0) + 1
            STATS["inflight"] += 1
            STATS["peak"] = max(STATS["peak"], STATS["inflight"])
            STATS["bodies"].append({k: body[k] for k in ("model", "temperature", "max_tokens") if k in body})
            STATS["roles"].append([m["role"] for m in body["messages"]])
            STATS["times"].setdefault(marker, []).append(time.monotonic() - T0)
            STATS["auth"].append("Authorization" in self.headers)
        time.sleep(0.05)  # long enough for concurrent requests to overlap
        if marker == "fail" or (marker == "flaky" and seen == 1):
            reply = (500 if marker == "fail" else 503, '{"error": "judge down"}', None)
        elif marker == "limited" and seen == 1:
            reply = (429, '{"error": "slow down"}', {"Retry-After": "1"})
        elif marker == "farday" and seen == 1:  # a year past datetime's: parsedate_to_datetime overflows
            reply = (503, '{"error": "down"}', {"Retry-After": "1 Jan 9999999999 00:00 GMT"})
        elif marker == "gzip":  # as a misconfigured proxy sends
            reply = (200, '{"choices": []}', {"Content-Encoding": "gzip"})
        else:
            choice = {"index": 0, "message": {"role": "assistant", "content": REPLIES.get(marker, "")}}
            reply = (200, json.dumps({"choices": [choice]}), None)
        # Out of flight before the reply is written: once a client has read it, it may send its next request,
        # and that must not meet this one still counted (a peak of concurrency + 1 that the client never had).
        with LOCK:
            STATS["inflight"] -= 1
        if marker == "trickle":  # each read within any read timeout, the whole never
            data = reply[1].encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            for byte in data:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.2)
            return
        self._send(*reply)


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
