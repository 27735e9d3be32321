"""Serve a chat model: OpenAI's chat API (`POST /v1/chat/completions`, `GET /v1/models`) and a web
page at `/` (serve.html beside this file), on Starlette and uvicorn. docs/chat.md ("Serve it")
states what is supported.

One worker thread steps the model for every request, one model step at a time, taking the requests
in turn: each has its own KV cache and its own seeded generator, so a request's tokens are the ones
it gets alone, however many others run beside it. A client that leaves has its generation dropped
at the worker's next turn. Every request that cannot be served gets OpenAI's error JSON with a 4xx
status; a bug gets a generic 500 JSON, its traceback in the server's log only.

The model comes in as a value (train_gpt2.py's serve command builds it from a checkpoint), so this
file never imports the training script. Importing it starts nothing, and imports neither the web
stack nor torch.
"""

import asyncio
import collections
import contextlib
import errno
import json
import logging
import math
import os
import queue
import secrets
import signal
import socket
import threading
import time
from dataclasses import dataclass

import chat
from common import UsageError, one_line

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve.html")
MAX_BODY_BYTES = 1 << 20  # a request's body: far beyond any conversation a context holds
MAX_STOPS = 4  # stop strings a request may give (OpenAI's limit)
OWNER = "train_gpt2.py"  # /v1/models' owned_by
log = logging.getLogger("serve")


# ===== Errors: OpenAI's error JSON ===============================================================
class ApiError(Exception):
    """A request that is not served: its HTTP status and OpenAI's error object."""

    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                       code, kind)

    def body(self):
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad(message, param=None, code=None):
    return ApiError(400, message, param, code)


# ===== Sampling ==================================================================================
def filtered_probs(logits, temperature, top_k=None, top_p=1.0):
    """(probabilities, token ids) of the tokens a sample may pick from logits (1, V): softmax at
    temperature over the top_k likeliest (None: all), then the fewest of those whose probability
    adds up to top_p (the nucleus; the likeliest token always stays). The probabilities are not
    renormalized after top_p (torch.multinomial needs no sum of 1)."""
    import torch

    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        values, ids = torch.topk(logits, top_k, dim=-1)  # sorted, likeliest first
    elif top_p < 1:
        values, ids = torch.sort(logits, dim=-1, descending=True)
    else:  # every token, in vocabulary order
        values, ids = logits, None
    probs = torch.softmax(values, dim=-1)
    if top_p < 1:
        before = probs.cumsum(-1) - probs  # the mass of the likelier tokens
        probs = probs * (before < top_p)
    return probs, ids


def sample(logits, temperature, top_k, top_p, generator):
    """A token id (1, 1) from logits (1, V): greedy at temperature 0 or top_k 1, else drawn with
    generator from filtered_probs. Without top_p it draws as train_gpt2.sample_next does, so a
    seed gives the chat command's tokens."""
    import torch

    if temperature == 0 or top_k == 1:
        return logits.argmax(dim=-1, keepdim=True)
    probs, ids = filtered_probs(logits, temperature, top_k, top_p)
    choice = torch.multinomial(probs, 1, generator=generator)
    return choice if ids is None else torch.gather(ids, -1, choice)


class StopText:
    """Text pieces cut at the first of some stop strings. Text that could still begin one is
    held back until the next piece tells, so a stop string split over tokens is still found and
    none of it is ever given out."""

    def __init__(self, stops):
        self.stops, self.held = stops, ""

    def push(self, text):
        """(the text that can be given out now, whether a stop string was met)."""
        text = self.held + text
        found = [text.find(s) for s in self.stops if s in text]
        if found:
            self.held = ""
            return text[: min(found)], True
        keep = 0  # the longest end of text that begins a stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if text.endswith(s[:k]):
                    keep = k
                    break
        self.held = text[len(text) - keep:]
        return text[: len(text) - keep], False

    def flush(self):
        text, self.held = self.held, ""
        return text


# ===== Requests ==================================================================================
@dataclass
class Request:
    """A chat completion request, checked: the prompt's ids and how to sample its reply."""
    prompt: list
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stops: list
    stream: bool = False
    include_usage: bool = False


@dataclass
class Defaults:
    """What the serve command's flags set: the sampling of a request that says nothing of it."""
    temperature: float = 0.6
    top_k: int = 50
    max_tokens: int = None  # None: the rest of the context
    seed: int = None  # None: an unseeded request gets a random seed


ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system message
MESSAGE_KEYS = {"role", "content", "name"}
# accepted and of no effect: what the client may send about itself or how it is billed
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prediction"}
# accepted only as their no-op values
NO_OPS = {"n": (1,), "presence_penalty": (0,), "frequency_penalty": (0,), "logprobs": (False,),
          "top_logprobs": (0,), "logit_bias": ({},), "tools": ([],), "functions": ([],),
          "tool_choice": ("none",), "function_call": ("none",), "modalities": (["text"],),
          "response_format": ({"type": "text"},)}
KNOWN = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
         "top_k", "seed", "stop", "stream", "stream_options", *IGNORED, *NO_OPS}
UNSUPPORTED = {"n": "n > 1 (one reply a request)", "tools": "tools", "functions": "functions",
               "tool_choice": "tool_choice", "function_call": "function_call",
               "logprobs": "logprobs", "top_logprobs": "top_logprobs",
               "logit_bias": "logit_bias", "modalities": "modalities other than text",
               "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
               "response_format": "response_format other than text"}


def _number(body, key, low, high, integer=False, low_open=False):
    """body[key] (absent or null: None), a number in [low, high] (an int where integer)."""
    value = body.get(key)
    if value is None:
        return None
    want = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise bad(f"'{key}' must be {want}, not {json.dumps(value)[:40]}", key, "invalid_type")
    above = value > low if low_open else value >= low
    if not (math.isfinite(value) and above and value <= high):
        side = ">" if low_open else ">="
        raise bad(f"'{key}' must be {side} {low} and <= {high}, not {value}", key,
                  "invalid_value")
    return value


def _content(m, k):
    """A message's text: a string, or OpenAI's list of text parts (joined)."""
    content = m.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                what = f"content of type {json.dumps(kind)[:30]}" if kind else "a content part"
                raise bad(f"messages[{k}] holds {what}: this model reads text only",
                          f"messages[{k}].content[{j}]", "unsupported_content")
            if not isinstance(part.get("text"), str):
                raise bad(f"messages[{k}].content[{j}].text must be a string",
                          f"messages[{k}].content[{j}].text", "invalid_type")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"messages[{k}].content must be a string or a list of text parts",
              f"messages[{k}].content", "invalid_type")


def _a(role):
    return f"an {role}" if role == "assistant" else f"a {role}"  # a user, a system


def read_messages(messages):
    """chat.py's messages ({role, content} with string content) of a request's messages: an
    optional system message first, then user and assistant turns alternating, ending with the
    user's (the one answered)."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of messages", "messages",
                  "invalid_type" if not isinstance(messages, list) else "invalid_value")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{k}] must be an object with a role and a content",
                      f"messages[{k}]", "invalid_type")
        role = ROLE_ALIASES.get(m.get("role"), m.get("role"))
        if role not in chat.ROLES:
            raise bad(f"messages[{k}] has the role {json.dumps(m.get('role'))[:40]}: this model "
                      f"takes system, user and assistant messages", f"messages[{k}].role",
                      "invalid_value")
        for key in sorted(set(m) - MESSAGE_KEYS):
            if m[key] is not None:
                raise bad(f"messages[{k}].{key} is not supported (no tools or audio here)",
                          f"messages[{k}].{key}", "unsupported_parameter")
        out.append({"role": role, "content": _content(m, k)})
    turns = out[1:] if out[0]["role"] == "system" else out
    for k, m in enumerate(turns):
        want = "user" if k % 2 == 0 else "assistant"
        if m["role"] != want:
            at = k + len(out) - len(turns)
            raise bad(f"messages[{at}] is {_a(m['role'])} message where {_a(want)} one is due: an "
                      f"optional system message first, then user and assistant turns "
                      f"alternating, ending with the user's", f"messages[{at}].role",
                      "invalid_value")
    if not turns or turns[-1]["role"] != "user":
        raise bad("the last message must be the user's: it is the one answered", "messages",
                  "invalid_value")
    return out


def read_request(body, enc, model_name, block_size, defaults):
    """The Request of a parsed JSON body, or an ApiError saying what is wrong with it."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None, "invalid_type")
    for key in sorted(body):
        if key not in KNOWN:
            raise bad(f"Unrecognized request argument supplied: {key[:60]}", key[:60],
                      "unknown_parameter")
        if key in NO_OPS and body[key] is not None and body[key] not in NO_OPS[key]:
            raise bad(f"'{key}' is not supported: {UNSUPPORTED[key]}", key,
                      "unsupported_parameter")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model", "invalid_type")
    if model is not None and model != model_name:
        raise ApiError(404, f"The model {json.dumps(model)[:80]} does not exist: this server "
                            f"serves {json.dumps(model_name)}", "model", "model_not_found")
    messages = read_messages(body.get("messages"))
    wanted = {key: _number(body, key, 1, block_size, integer=True)
              for key in ("max_tokens", "max_completion_tokens")}
    if None not in wanted.values() and len(set(wanted.values())) > 1:
        raise bad("give one of 'max_tokens' and 'max_completion_tokens'", "max_tokens",
                  "invalid_value")
    asked = wanted["max_completion_tokens"] or wanted["max_tokens"]
    param = "max_completion_tokens" if wanted["max_completion_tokens"] else "max_tokens"
    if asked and defaults.max_tokens and asked > defaults.max_tokens:
        raise bad(f"'{param}' is {asked}: this server gives at most {defaults.max_tokens} "
                  f"tokens a reply", param, "invalid_value")
    temperature = _number(body, "temperature", 0, 2)
    top_p = _number(body, "top_p", 0, 1, low_open=True)
    top_k = _number(body, "top_k", 1, 1 << 30, integer=True)
    seed = _number(body, "seed", -(1 << 63), (1 << 64) - 1, integer=True)
    stops = body.get("stop")
    if isinstance(stops, str):
        stops = [stops]
    if stops is None:
        stops = []
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)):
        raise bad(f"'stop' must be a string or a list of up to {MAX_STOPS} non-empty strings",
                  "stop", "invalid_value")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("'stream' must be true or false", "stream", "invalid_type")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise bad("'stream_options' is an object, given with 'stream': true", "stream_options",
                  "invalid_value")
    prompt = chat.render_prompt(messages, enc)
    room = block_size - len(prompt)
    if room < 1 or (asked and asked > room):
        reply = f"{asked} in the reply" if asked else "none left for the reply"
        raise bad(f"This model's maximum context length is {block_size} tokens. However, your "
                  f"messages resulted in {len(prompt)} tokens ({reply}). Please reduce the "
                  f"length of the messages{' or of the reply' if asked else ''}.", "messages",
                  "context_length_exceeded")
    if not asked:
        asked = min(room, defaults.max_tokens or room)
    if seed is None:
        seed = defaults.seed if defaults.seed is not None else secrets.randbits(64)
    return Request(prompt=prompt, max_tokens=asked,
                   temperature=defaults.temperature if temperature is None else temperature,
                   top_k=top_k or defaults.top_k, top_p=1.0 if top_p is None else top_p,
                   seed=seed % (1 << 64), stops=stops, stream=bool(stream),
                   include_usage=bool((options or {}).get("include_usage")))


# ===== The engine: one worker thread stepping every request ======================================
SHUTTING_DOWN = "the server is shutting down"


class Job:
    """One request's generation, fed by the engine's worker a model step at a time. Its events go
    to emit (called from the worker thread): ("text", piece), then ("end", finish_reason) or
    ("error", ApiError)."""

    def __init__(self, request, enc, emit, name="request"):
        self.request, self.emit, self.name = request, emit, name
        self.ids = list(request.prompt)
        self.cache = self.generator = None  # made at the job's first step, in the worker
        self.text, self.stops = chat.TextStream(enc), StopText(request.stops)
        self.end = chat.tokens_of(enc).end["assistant"]
        self.tokens = 0  # sampled so far, <|assistant_end|> included
        self.finish = None
        self.cancelled = False  # set by the request's side when its client leaves

    def cancel(self):
        self.cancelled = True

    def add(self, token):
        """The sampled token: its text given out, and the end when it is one."""
        self.tokens += 1
        if token == self.end:
            return self._end("stop")
        self.ids.append(token)
        if self._give(self.text.push(token)):
            return self._end("stop", flush=False)
        if self.tokens == self.request.max_tokens:
            self._end("length")

    def fail(self, error):
        self.finish = "error"
        self.emit(("error", error))

    def _give(self, piece):
        """piece given out up to a stop string; whether one was met."""
        out, stopped = self.stops.push(piece)
        if out:
            self.emit(("text", out))
        return stopped

    def _end(self, reason, flush=True):
        if flush and not self._give(self.text.flush()):
            tail = self.stops.flush()
            if tail:
                self.emit(("text", tail))
        self.finish = reason
        self.emit(("end", reason))


class Engine:
    """The model's one worker thread: each turn it takes the jobs submitted since the last, then
    gives every running job one model step (a new job's first step runs its whole prompt). A job
    whose request was cancelled is dropped before its next step."""

    def __init__(self, model, enc, device="cpu", dtype=None, autocast=None, max_jobs=64):
        self.model, self.enc, self.device, self.dtype = model, enc, device, dtype
        self.autocast = autocast if autocast is not None else contextlib.nullcontext()
        self.n_vocab = model.config.real_vocab_size  # the padding rows are never sampled
        self.block_size = model.config.block_size
        self.max_jobs = max_jobs
        self.inbox = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.jobs = 0  # submitted and not finished
        self.closed = False
        self.thread = None

    def start(self):
        self.thread = threading.Thread(target=self._run, name="serve-engine", daemon=True)
        self.thread.start()

    def submit(self, job):
        """Queue the job for the worker: a 429 ApiError when max_jobs are running, a 503 once the
        engine is stopping."""
        with self.lock:
            if self.closed:
                raise ApiError(503, SHUTTING_DOWN, code="shutting_down", kind="server_error")
            if self.jobs >= self.max_jobs:
                raise ApiError(429, f"the server is busy: {self.max_jobs} requests are being "
                                    f"answered; try again shortly", code="server_busy",
                               kind="rate_limit_error")
            self.jobs += 1
        self.inbox.put(job)

    def stop(self, timeout=2.0):
        """Every job ended with a 503 error, the worker thread stopped (waited for up to
        timeout)."""
        with self.lock:
            first, self.closed = not self.closed, True
        if first:
            self.inbox.put(None)
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def step(self, job):
        """One model step of job: its new ids run through its KV cache, a token sampled."""
        import torch

        r = job.request
        if job.cache is None:
            job.cache = self.model.make_kv_cache(1, len(job.ids) + r.max_tokens, self.device,
                                                 self.dtype)
            job.generator = torch.Generator(device=self.device).manual_seed(r.seed)
        new = torch.tensor([job.ids[job.cache.pos:]], dtype=torch.long, device=self.device)
        with torch.inference_mode(), self.autocast:
            logits, _ = self.model(new, kv_cache=job.cache, logits_to_keep=1)
        token = sample(logits[:, -1, : self.n_vocab], r.temperature, r.top_k, r.top_p,
                       job.generator)
        job.add(int(token.item()))

    def _done(self, job):
        with self.lock:
            self.jobs -= 1
        job.cache = None  # its memory freed now, not when the request's side lets go of it

    def _run(self):
        running = []
        while True:
            block = not running
            while True:  # every job submitted so far joins this turn
                try:
                    job = self.inbox.get(block=block)
                except queue.Empty:
                    break
                if job is None:
                    return self._shut(running)
                running.append(job)
                block = False
            for job in list(running):
                if not job.cancelled:
                    try:
                        self.step(job)
                    except Exception:  # a bug, or the device out of memory: this job only
                        log.exception("%s: the model step failed", job.name)
                        job.fail(ApiError(500, "the server failed to generate the reply (its "
                                               "log says why)", kind="server_error"))
                if job.cancelled and job.finish is None:
                    log.info("%s: the client left: stopped after %d of up to %d tokens",
                             job.name, job.tokens, job.request.max_tokens)
                    job.fail(ApiError(499, "the client closed the connection",
                                      code="client_closed"))  # to no one: it ends the request
                if job.finish is not None:
                    running.remove(job)
                    self._done(job)

    def _shut(self, running):
        while True:
            try:
                job = self.inbox.get(block=False)
            except queue.Empty:
                break
            if job is not None:
                running.append(job)
        for job in running:
            job.fail(ApiError(503, SHUTTING_DOWN, code="shutting_down", kind="server_error"))
            self._done(job)


# ===== The web app ===============================================================================
def _json(data, status=200):
    from starlette.responses import JSONResponse

    return JSONResponse(data, status_code=status)


def _error(e):
    return _json(e.body(), e.status)


async def _read_body(request):
    """The request's body, at most MAX_BODY_BYTES (a 413 ApiError beyond)."""
    too_big = ApiError(413, f"the request body is over the limit of {MAX_BODY_BYTES:,} bytes",
                       code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(body):
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested beyond Python's
        what = one_line(e, 120) if isinstance(e, ValueError) else "nested too deeply"
        raise bad(f"We could not parse the JSON body of your request ({what}). The body must be "
                  f"one JSON object.", None, "invalid_json") from None


class Events:
    """A job's events, from the worker thread to the event loop. The loop is woken once for all
    the events that come before it looks (not once for each), and takes them together: a stream
    that falls behind the model sends what it owes in one chunk."""

    def __init__(self, loop):
        self.loop, self.items, self.ready = loop, collections.deque(), asyncio.Event()
        self.woken = False

    def put(self, event):  # in the worker thread
        self.items.append(event)
        if not self.woken:
            self.woken = True
            try:
                self.loop.call_soon_threadsafe(self.ready.set)
            except RuntimeError:  # the loop closed: the server stopped without waiting
                pass

    async def take(self):
        """The events come since the last take (at least one): [("text", joined pieces)] first
        if any, then the end or error if it came."""
        await self.ready.wait()
        self.ready.clear()
        self.woken = False  # before the events are taken: one put after it wakes the loop again
        texts, out = [], []
        while self.items:
            kind, value = self.items.popleft()
            if kind == "text":
                texts.append(value)
            else:
                out.append((kind, value))
        return ([("text", "".join(texts))] if texts else []) + out


class App:
    """The routes' state: the engine, the model's name and context, the defaults, the page."""

    def __init__(self, engine, name, defaults, created=None):
        self.engine, self.name, self.defaults = engine, name, defaults
        self.created = int(created if created is not None else time.time())
        with open(PAGE, "rb") as f:
            self.page = f.read()

    def model_card(self):
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": OWNER,
                "context_length": self.engine.block_size}

    async def page_route(self, request):
        from starlette.responses import Response

        return Response(self.page, media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})

    async def models(self, request):
        return _json({"object": "list", "data": [self.model_card()]})

    async def model(self, request):
        if request.path_params["model"] != self.name:
            raise ApiError(404, f"The model {json.dumps(request.path_params['model'])[:80]} does "
                                f"not exist", "model", "model_not_found")
        return _json(self.model_card())

    async def completions(self, request):
        from starlette.responses import StreamingResponse

        body = _parse(await _read_body(request))
        r = read_request(body, self.engine.enc, self.name, self.engine.block_size, self.defaults)
        events = Events(asyncio.get_running_loop())
        rid = f"chatcmpl-{secrets.token_hex(12)}"
        job = Job(r, self.engine.enc, events.put, rid)
        self.engine.submit(job)
        head = {"id": rid, "created": int(time.time()), "model": self.name,
                "system_fingerprint": None}
        t0 = time.perf_counter()
        if r.stream:
            return StreamingResponse(self._stream(job, events, head, t0),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Accel-Buffering": "no"})
        return await self._whole(request, job, events, head, t0)

    def _usage(self, job):
        n = len(job.request.prompt)
        return {"prompt_tokens": n, "completion_tokens": job.tokens,
                "total_tokens": n + job.tokens}

    def _logged(self, job, t0, how):
        log.info("%s: %s, %d prompt + %d reply tokens, %s, %.2f s", job.name, how,
                 len(job.request.prompt), job.tokens, job.finish, time.perf_counter() - t0)

    async def _whole(self, request, job, events, head, t0):
        """The non-streamed reply, once it is whole; the job cancelled if the client leaves."""
        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.cancel()

        watcher = asyncio.ensure_future(watch())
        texts = []
        try:
            ended = False
            while not ended:
                for kind, value in await events.take():
                    if kind == "error":
                        raise value
                    ended = kind == "end"
                    if kind == "text":
                        texts.append(value)
        finally:
            watcher.cancel()
            job.cancel()  # a no-op once it ended
        self._logged(job, t0, "whole")
        message = {"role": "assistant", "content": "".join(texts), "refusal": None}
        return _json({**head, "object": "chat.completion",
                      "choices": [{"index": 0, "message": message, "logprobs": None,
                                   "finish_reason": job.finish}],
                      "usage": self._usage(job)})

    async def _stream(self, job, events, head, t0):
        """Server-sent events in OpenAI's chunk format, then `data: [DONE]`. The client leaving
        cancels this generator (Starlette watches for it), which cancels the job."""
        def chunk(delta, finish=None):
            data = {**head, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                 "finish_reason": finish}]}
            return f"data: {json.dumps(data)}\n\n"

        try:
            yield chunk({"role": "assistant", "content": ""})
            ended = False
            while not ended:
                out = []
                for kind, value in await events.take():
                    ended = kind != "text"
                    if kind == "text":
                        out.append(chunk({"content": value}))
                    elif kind == "error":
                        out.append(f"data: {json.dumps(value.body())}\n\n")
                    else:
                        out.append(chunk({}, job.finish))
                        if job.request.include_usage:
                            usage = {**head, "object": "chat.completion.chunk", "choices": [],
                                     "usage": self._usage(job)}
                            out.append(f"data: {json.dumps(usage)}\n\n")
                        self._logged(job, t0, "streamed")
                if out:  # none when a wake-up's events were taken at the one before
                    yield "".join(out)
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()  # a no-op once it ended


def make_app(engine, name, defaults, created=None, on_startup=None):
    """The Starlette app of engine (started and stopped with the app's lifespan): the page at /,
    the API at /v1. on_startup() runs once the engine is up."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    app = App(engine, name, defaults, created)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        engine.start()
        if on_startup is not None:
            on_startup()
        try:
            yield
        finally:
            engine.stop()

    async def http_error(request, e):  # no such route, or a method it does not take
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = e.detail
        if e.status_code == 404:
            message = f"no such route: {request.url.path[:100]}"
        elif e.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path[:100]}"
        return _json(ApiError(e.status_code, message, None, code).body(), e.status_code)

    async def api_error(request, e):
        return _error(e)

    async def bug(request, e):  # the traceback goes to the log (Starlette re-raises it there)
        return _json(ApiError(500, "the server met an error (its log says which)",
                              kind="server_error").body(), 500)

    routes = [Route("/", app.page_route),
              Route("/v1/models", app.models),
              Route("/v1/models/{model:path}", app.model),
              Route("/v1/chat/completions", app.completions, methods=["POST"])]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error, ApiError: api_error,
                                         Exception: bug})


# ===== Serving: the socket, uvicorn, the stop signals ============================================
def listen(host, port):
    """A socket listening on host:port (port 0: a free one), or a UsageError in one line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart binds at once
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        hint = ": give another --port" if e.errno == errno.EADDRINUSE else ""
        raise UsageError(f"cannot listen on {host} port {port}: {e.strerror or e}{hint}") from None
    return sock


def url_of(sock):
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/"


def serve(engine, name, sock, defaults=None, created=None, describe=""):
    """Serve until SIGTERM or Ctrl-C (status 0): a first signal ends the running generations (their
    clients get a 503 error) and closes the socket at once; a second Ctrl-C stops without
    waiting. Prints the URL when ready."""
    try:
        import uvicorn
    except ImportError as e:
        raise UsageError(f"the serve command needs {e.name}: pip install -r requirements.txt") \
            from None
    if not logging.getLogger().handlers and not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    url = url_of(sock)

    def ready():
        print(f"serving {name}{describe} at {url} (the page; OpenAI's API at {url}v1). "
              f"Ctrl-C stops.", flush=True)

    app = make_app(engine, name, defaults or Defaults(), created, ready)

    class Server(uvicorn.Server):
        """uvicorn's server, which a stop signal ends with status 0 (uvicorn raises the signal
        again once it has shut down, which would kill the process or raise KeyboardInterrupt),
        the running generations ended at once rather than waited for."""

        def __init__(self, config):
            super().__init__(config)
            self.stopped_by = None

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            before = {s: signal.signal(s, self.stop) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in before.items():
                    signal.signal(s, handler)

        def stop(self, signum, frame):
            if self.should_exit and signum == signal.SIGINT:
                self.force_exit = True
            self.should_exit, self.stopped_by = True, signum
            threading.Thread(target=engine.stop, daemon=True).start()  # not in a signal handler

    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1,
                            lifespan="on")
    server = Server(config)
    server.run(sockets=[sock])
    sock.close()
    if server.stopped_by is not None:
        print(f"stopped by {signal.Signals(server.stopped_by).name}", flush=True)
    return 0
