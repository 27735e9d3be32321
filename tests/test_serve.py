"""The serve command (serve.py): OpenAI's chat API and the web page of a live server on 127.0.0.1,
driven by the official `openai` client, raw HTTP and a headless Chromium. The greedy reply is the
model's own (recomputed over the whole conversation for each token), a seeded one the chat
command's; top_k and top_p are transformers' warpers; concurrent requests each get what they get
alone; a client that leaves stops its generation; every bad request is OpenAI's error JSON with a
4xx; SIGTERM and Ctrl-C end the server and free the port."""
import http.client
import json
import os
import queue
import re
import shutil
import signal
import socket
import sys
import threading
import types

import pytest
import torch

import chat
import serve
import train_gpt2 as tg
from helpers import (HANG_LIMIT_S, REPO, assert_one_line_error, chat_model, output, plain_reply,
                     popen_to_files, run_cli, save_checkpoint, tiny_model, wait_until)

openai = pytest.importorskip("openai")  # requirements.txt's tests section installs it

NAME = "tiny-chat"
CONTEXT = 1024  # room for a generation long enough that a client leaving surely cuts it short
AE = chat.END["assistant"]


# ===== The live server: one for the module ========================================================
class Live:
    def __init__(self, proc, url, ckpt):
        self.proc, self.url, self.ckpt = proc, url, ckpt
        self.host, self.port = re.match(r"http://([\d.]+):(\d+)/", url).groups()
        self.port = int(self.port)

    def client(self):
        return openai.OpenAI(base_url=self.url + "v1", api_key="none", max_retries=0,
                             timeout=HANG_LIMIT_S)

    def log(self):
        return output(self.proc)[1]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    ckpt = save_checkpoint(chat_model(block_size=CONTEXT), folder / "model.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = popen_to_files([sys.executable, os.path.join(REPO, "train_gpt2.py"), "serve",
                           "--checkpoint", ckpt, "--port", "0", "--device", "cpu",
                           "--model_name", NAME], env, folder, "server")
    try:
        wait_until(lambda: "serving" in output(proc)[0], [proc], "the server is ready")
        url = re.search(r"at (http://\S+/) ", output(proc)[0]).group(1)
        yield Live(proc, url, ckpt)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(HANG_LIMIT_S)
        proc.out.close()
        proc.err.close()


@pytest.fixture(scope="module")
def reference(live):
    """The served checkpoint's model, in this process."""
    return tg.model_from_checkpoint(torch.load(live.ckpt, weights_only=True), live.ckpt).eval()


def greedy_text(model, enc, messages, max_tokens):
    """The greedy reply recomputed token by token: its text and whether it ended on its own."""
    prompt = chat.render_prompt(messages, enc)
    reply = plain_reply(model, prompt, max_tokens)
    ended = len(reply) < max_tokens
    return enc.decode([t for t in reply if t < chat.EOT]), ended, len(prompt), len(reply) + ended


def user(text):
    return [{"role": "user", "content": text}]


def stream_text(client, **kw):
    """(the text of a streamed reply, its finish_reason, its usage), the chunks checked."""
    chunks = list(client.chat.completions.create(model=NAME, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    first, *middle, last, usage = chunks
    assert first.choices[0].delta.role == "assistant" and first.object == "chat.completion.chunk"
    assert len({c.id for c in chunks}) == 1 and usage.choices == []
    assert all(c.choices[0].finish_reason is None for c in [first, *middle])
    text = "".join(c.choices[0].delta.content or "" for c in [first, *middle])
    return text, last.choices[0].finish_reason, usage.usage


# ===== What the API answers =======================================================================
def test_models_lists_the_one_model(live):
    client = live.client()
    assert [m.id for m in client.models.list()] == [NAME]
    assert client.models.retrieve(NAME).owned_by == serve.OWNER
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_the_greedy_reply_is_the_models_own_streamed_or_not(live, reference, enc):
    client = live.client()
    messages = [{"role": "system", "content": "Be brief."}, *user("Hi!"),
                {"role": "assistant", "content": "Hello. What is up?"},
                {"role": "user", "content": [{"type": "text", "text": "The capital of "},
                                             {"type": "text", "text": "France, 日本?"}]}]
    flat = [*messages[:3], user("The capital of France, 日本?")[0]]
    want, ended, n_prompt, n_reply = greedy_text(reference, enc, flat, 12)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12,
                                       temperature=0)
    assert r.choices[0].message.content == want and r.object == "chat.completion"
    assert r.choices[0].finish_reason == ("stop" if ended else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, n_reply)
    assert r.usage.total_tokens == n_prompt + n_reply
    text, finish, usage = stream_text(client, messages=messages, max_completion_tokens=12,
                                      temperature=0)
    assert (text, finish) == (want, r.choices[0].finish_reason)
    assert usage.model_dump() == r.usage.model_dump()


def test_a_seeded_reply_is_the_chat_commands(live):
    kw = dict(model=NAME, messages=user("Hi!"), max_tokens=10, temperature=1.2, seed=7)
    client = live.client()
    got = client.chat.completions.create(**kw, extra_body={"top_k": 20})
    r = run_cli("chat", "--checkpoint", live.ckpt, "--prompt", "Hi!", "--seed", "7",
                "--temperature", "1.2", "--top_k", "20", "--max_new_tokens", "10",
                "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert got.choices[0].message.content + "\n" == r.stdout
    # top_p: the same seed, the same reply; another seed, another
    nucleus = [client.chat.completions.create(**{**kw, "seed": seed}, top_p=0.9).choices[0]
               .message.content for seed in (7, 7, 8)]
    assert nucleus[0] == nucleus[1] != nucleus[2]


def test_stop_strings_cut_the_reply(live, reference, enc):
    client = live.client()
    want, _, _, _ = greedy_text(reference, enc, user("Hi!"), 12)
    stop = want[len(want) // 3: len(want) // 3 + 3]  # inside the reply, likely over two tokens
    cut = want[: want.index(stop)]
    r = client.chat.completions.create(model=NAME, messages=user("Hi!"), max_tokens=12,
                                       temperature=0, stop=[stop, "never said"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (cut, "stop")
    assert r.usage.completion_tokens < 12
    text, finish, _ = stream_text(client, messages=user("Hi!"), max_tokens=12, temperature=0,
                                  stop=stop)
    assert (text, finish) == (cut, "stop")


# ===== What it refuses ============================================================================
LONG = "word " * (CONTEXT + 10)
REFUSED = [  # (what the client sends, the exception, words of the message, param)
    (dict(n=2), openai.BadRequestError, "n > 1", "n"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]),
     openai.BadRequestError, "tools", "tools"),
    (dict(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]),
     openai.BadRequestError, "text only", "messages[0].content[0]"),
    (dict(model="gpt-4o"), openai.NotFoundError, "does not exist", "model"),
    (dict(messages=user(LONG)), openai.BadRequestError, "maximum context length is 1024",
     "messages"),
    (dict(messages=user("Hi!"), max_tokens=CONTEXT), openai.BadRequestError,
     "maximum context length", "messages"),
    (dict(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]),
     openai.BadRequestError, "the role \"tool\"", "messages[0].role"),
    (dict(messages=[*user("a"), *user("b")]), openai.BadRequestError,
     "a user message where an assistant one is due", "messages[1].role"),
    (dict(messages=[*user("a"), {"role": "assistant", "content": "b"}]),
     openai.BadRequestError, "the last message must be the user's", "messages"),
    (dict(messages=[]), openai.BadRequestError, "non-empty list", "messages"),
    (dict(temperature="hot"), openai.BadRequestError, "must be a number", "temperature"),
    (dict(temperature=3), openai.BadRequestError, "<= 2", "temperature"),
    (dict(max_tokens=0), openai.BadRequestError, "'max_tokens' must be >= 1", "max_tokens"),
    (dict(top_p=0), openai.BadRequestError, "'top_p' must be > 0", "top_p"),
    (dict(stop=["a", "b", "c", "d", "e"]), openai.BadRequestError, "up to 4", "stop"),
    (dict(logprobs=True), openai.BadRequestError, "logprobs", "logprobs"),
    (dict(extra_body={"best_of": 3}), openai.BadRequestError, "Unrecognized request argument",
     "best_of"),
]


@pytest.mark.parametrize("kw,error,words,param", REFUSED)
def test_what_is_not_served_is_a_4xx_in_openais_error_json(live, kw, error, words, param):
    with pytest.raises(error) as e:
        live.client().chat.completions.create(**{"model": NAME, "messages": user("Hi!"), **kw})
    assert 400 <= e.value.status_code < 500 and words in e.value.message
    assert set(e.value.body) == {"message", "type", "param", "code"} and e.value.param == param


def raw(live, method, path, body=b"", headers=None):
    """(status, parsed JSON) of a plain HTTP request."""
    conn = http.client.HTTPConnection(live.host, live.port, timeout=HANG_LIMIT_S)
    try:
        conn.request(method, path, body, headers or {})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


@pytest.mark.parametrize("method,path,body,status,words", [
    ("POST", "/v1/chat/completions", b'{"messages": [', 400, "could not parse the JSON"),
    ("POST", "/v1/chat/completions", b"\xff\xfe{}", 400, "could not parse the JSON"),
    ("POST", "/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    ("POST", "/v1/chat/completions", b'["messages"]', 400, "must be a JSON object"),
    ("POST", "/v1/chat/completions", b"{" + b" " * serve.MAX_BODY_BYTES + b"}", 413,
     "over the limit"),
    ("GET", "/v1/chat/completions", b"", 405, "GET is not allowed"),
    ("GET", "/v1/nothing", b"", 404, "no such route"),
])
def test_bad_http_is_a_4xx_in_openais_error_json(live, method, path, body, status, words):
    got, data = raw(live, method, path, body)
    assert got == status and words in data["error"]["message"]
    assert set(data["error"]) == {"message", "type", "param", "code"}


def test_an_oversized_body_without_a_length_is_refused_too(live):
    def chunks():
        for _ in range(serve.MAX_BODY_BYTES // 4096 + 2):
            yield b" " * 4096

    conn = http.client.HTTPConnection(live.host, live.port, timeout=HANG_LIMIT_S)
    try:
        conn.request("POST", "/v1/chat/completions", chunks(), encode_chunked=True,
                     headers={"Transfer-Encoding": "chunked"})
        r = conn.getresponse()
        assert r.status == 413 and "over the limit" in json.loads(r.read())["error"]["message"]
    finally:
        conn.close()


def test_after_every_refusal_the_server_still_serves_and_said_no_traceback(live):
    r = live.client().chat.completions.create(model=NAME, messages=user("Hi!"), max_tokens=3)
    assert r.usage.completion_tokens >= 1
    assert "Traceback" not in live.log() and "Exception" not in live.log()


# ===== Many clients, and clients that leave =======================================================
def test_concurrent_streams_each_get_what_they_get_alone(live):
    asks = [dict(messages=user(f"Tell me about {w}."), max_tokens=24, temperature=1.0, seed=s)
            for w, s in (("cats", 1), ("dogs", 2), ("rivers", 3), ("cats", 4))]
    alone = [stream_text(live.client(), **kw)[0] for kw in asks]
    together = [None] * len(asks)
    barrier = threading.Barrier(len(asks))

    def run(i):
        client = live.client()
        barrier.wait()
        together[i] = stream_text(client, **asks[i])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(asks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_LIMIT_S)
    assert together == alone and len(set(alone)) == len(alone)


def sse_request(live, body):
    """The connection of a chat request sent (its response not read yet)."""
    conn = http.client.HTTPConnection(live.host, live.port, timeout=HANG_LIMIT_S)
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    return conn


def read_events(response, n):
    """The data of the next n server-sent events of a streamed response."""
    events = []
    while len(events) < n:
        line = response.readline()
        assert line, events
        if line.startswith(b"data: "):
            events.append(line[6:].strip().decode())
    return events


def test_a_client_that_leaves_stops_its_generation(live):
    long = CONTEXT - 20
    conn = sse_request(live, {"messages": user("Hi!"), "stream": True, "max_tokens": long,
                              "temperature": 1.0})
    rid = json.loads(read_events(conn.getresponse(), 2)[0])["id"]
    conn.close()
    # the whole reply too: the client leaves before it comes
    sse_request(live, {"messages": user("Hi!"), "max_tokens": long - 1,
                       "temperature": 1.0}).close()
    # the next request is answered (a hang here is the test's timeout, not a speed claim)
    r = live.client().chat.completions.create(model=NAME, messages=user("Hi"), max_tokens=4)
    assert r.usage.completion_tokens >= 1
    said = {}

    def both_said():
        for m in re.finditer(r"(chatcmpl-\w+): the client left: stopped after (\d+) of up to "
                             r"(\d+) tokens", live.log()):
            said[int(m.group(3))] = (m.group(1), int(m.group(2)))
        return long in said and long - 1 in said

    wait_until(both_said, [live.proc], "the server says the clients left")
    assert said[long][0] == rid and said[long][1] < long and said[long - 1][1] < long - 1


# ===== The page, in a real browser ================================================================
def chromium_driver(tmp_path):
    """A headless Chromium (Debian's chromium and chromium-driver), or a skip with the reason; in
    CI (env CI set) their absence fails the test."""
    browser, driver = shutil.which("chromium"), "/usr/bin/chromedriver"
    missing = [what for what, there in (("chromium", browser), ("chromedriver",
                                         os.path.exists(driver))) if not there]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium")
    if missing:
        why = (f"{' and '.join(missing)} not installed (apt-get install chromium chromium-driver; "
               f"pip install -r requirements.txt)")
        if os.environ.get("CI"):
            pytest.fail(f"{why}: .ci/run installs them")
        pytest.skip(why)
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1000,760",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(driver), options=options)


def test_the_page_streams_answers_in_chromium(live, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    browser = chromium_driver(tmp_path)
    try:
        wait = WebDriverWait(browser, HANG_LIMIT_S)
        browser.get(live.url)
        wait.until(lambda b: b.find_element(By.ID, "model").text == NAME)
        for field, value in (("temperature", "0"), ("max_tokens", "16")):
            browser.find_element(By.ID, field).send_keys(value)
        history, client = [], live.client()
        for turn, text in enumerate(["Hi! What is a language model?", "Thanks. And a token?"]):
            browser.find_element(By.ID, "input").send_keys(text + Keys.ENTER)
            done = f"#log .assistant[data-done=true]:nth-of-type({2 * turn + 2})"
            answer = wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, done))[0]
            history += user(text)
            api = client.chat.completions.create(model=NAME, messages=history, max_tokens=16,
                                                 temperature=0).choices[0].message.content
            assert answer.get_attribute("textContent") == api
            history.append({"role": "assistant", "content": api})
        shot = tmp_path / "serve_page.png"
        assert browser.save_screenshot(str(shot))
        if os.environ.get("TEST_ARTIFACTS"):
            os.makedirs(os.environ["TEST_ARTIFACTS"], exist_ok=True)
            shutil.copy(shot, os.environ["TEST_ARTIFACTS"])
        assert not browser.find_elements(By.CSS_SELECTOR, "#log .error")
        browser.find_element(By.ID, "new").click()  # the conversation forgotten
        assert browser.find_elements(By.CSS_SELECTOR, "#log .msg") == []
    finally:
        browser.quit()


# ===== Sampling, stop strings and the engine, in this process =====================================
def test_top_k_and_top_p_keep_what_transformers_warpers_keep():
    from transformers.generation.logits_process import (TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 500, generator=g) * 3
    for temperature, top_k, top_p in ((1.0, None, 0.9), (0.7, 50, 0.5), (1.3, 20, 1.0),
                                      (1.0, None, 0.05)):
        probs, ids = serve.filtered_probs(logits, temperature, top_k, top_p)
        ours = torch.zeros(1, 500).scatter(-1, ids, probs) if ids is not None else probs
        ours = ours / ours.sum()
        warped = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            warped = TopKLogitsWarper(top_k)(None, warped)
        if top_p < 1:
            warped = TopPLogitsWarper(top_p)(None, warped)
        assert torch.allclose(ours, torch.softmax(warped, -1), atol=1e-6)
    # without top_p a seed draws the tokens train_gpt2.sample_next draws (the chat command's)
    for top_k in (None, 20):
        ga, gb = (torch.Generator().manual_seed(3) for _ in range(2))
        ours = [int(serve.sample(logits, 0.8, top_k, 1.0, ga)) for _ in range(20)]
        theirs = [int(tg.sample_next(logits, 0.8, top_k, gb)) for _ in range(20)]
        assert ours == theirs


def test_stop_strings_are_found_across_pieces_and_never_given_out():
    text = "one two, three; four two five"
    for stops in (["two,"], ["three;", "wo"], ["x", "five"], ["zzz"], [";", "ne"]):
        hits = [text.find(s) for s in stops if s in text]
        want = text[: min(hits)] if hits else text
        for size in (1, 2, 3, 7):
            cut, out, stopped = serve.StopText(stops), "", False
            for i in range(0, len(text), size):
                piece, stopped = cut.push(text[i: i + size])
                out += piece
                assert want.startswith(out)  # nothing past a stop, nothing taken back
                if stopped:
                    break
            out += "" if stopped else cut.flush()
            assert out == want and stopped == bool(hits)


class Scripted:
    """A model that answers each prompt with its script of tokens (logits that put the next one
    first), recording the prompt each forward served and its number of new tokens."""

    def __init__(self, scripts):
        self.config = types.SimpleNamespace(block_size=64, real_vocab_size=chat.CHAT_VOCAB_SIZE)
        self.scripts, self.calls = scripts, []

    def make_kv_cache(self, B, max_len, device, dtype):
        return types.SimpleNamespace(pos=0, ids=[])

    def __call__(self, idx, kv_cache, logits_to_keep):
        kv_cache.ids += idx[0].tolist()
        kv_cache.pos += idx.size(1)
        key = next(k for k in self.scripts if kv_cache.ids[: len(k)] == list(k))
        self.calls.append((self.scripts[key][0], idx.size(1)))
        if self.scripts[key][1] is None:
            raise RuntimeError("a bug in the model")
        n_sampled = len(kv_cache.ids) - len(key)
        logits = torch.zeros(1, 1, chat.CHAT_VOCAB_SIZE)
        logits[0, 0, self.scripts[key][1][n_sampled]] = 1.0
        return logits, None


def run_scripted(enc, scripts, max_jobs=64):
    """The events of a request for each script (name: tokens, None: the step fails) through an
    Engine of the Scripted model, all submitted before its first turn; the model and engine."""
    hello, world = enc.encode_ordinary(" hello world")
    prompts = {name: tuple(chat.render_prompt(user(name), enc)) for name in scripts}
    model = Scripted({prompts[name]: (name, tokens) for name, tokens in scripts.items()})
    engine = serve.Engine(model, enc, max_jobs=max_jobs)
    got = {name: queue.SimpleQueue() for name in scripts}
    for name in scripts:
        r = serve.read_request({"messages": user(name), "max_tokens": 4, "temperature": 0,
                                "stop": " hello" if name == "b" else None}, enc, NAME, 64,
                               serve.Defaults())
        engine.submit(serve.Job(r, enc, got[name].put, name))
    engine.start()
    events = {}
    for name, q in got.items():
        events[name] = [q.get(timeout=HANG_LIMIT_S)]
        while events[name][-1][0] == "text":
            events[name].append(q.get(timeout=HANG_LIMIT_S))
    return events, {name: len(p) for name, p in prompts.items()}, model, engine


def test_the_engine_gives_each_request_a_step_in_turn(enc):
    hello, world = enc.encode_ordinary(" hello world")
    events, n, model, engine = run_scripted(enc, {"a": [hello, world, AE], "b": [world] * 10})
    engine.stop()
    assert events["a"] == [("text", " hello"), ("text", " world"), ("end", "stop")]
    assert events["b"] == [("text", " world")] * 4 + [("end", "length")]
    # a turn: every running request one step, the first its whole prompt
    assert model.calls == [("a", n["a"]), ("b", n["b"]), ("a", 1), ("b", 1), ("a", 1), ("b", 1),
                           ("b", 1)]
    assert engine.jobs == 0


def test_a_failing_step_fails_its_request_alone_and_busy_or_stopped_is_refused(enc, caplog):
    hello, world = enc.encode_ordinary(" hello world")
    events, _, _, engine = run_scripted(enc, {"a": [hello, AE], "c": None}, max_jobs=2)
    (kind, error), = events["c"]
    assert kind == "error" and (error.status, error.kind) == (500, "server_error")
    assert events["a"] == [("text", " hello"), ("end", "stop")]
    assert "c: the model step failed" in caplog.text and "a bug in the model" in caplog.text
    engine.stop()
    assert not engine.thread.is_alive() and engine.jobs == 0
    r = serve.read_request({"messages": user("a")}, enc, NAME, 64, serve.Defaults())
    with pytest.raises(serve.ApiError) as e:
        engine.submit(serve.Job(r, enc, print))
    assert (e.value.status, e.value.code) == (503, "shutting_down")
    idle = serve.Engine(engine.model, enc, max_jobs=2)  # no worker: what is submitted stays
    for _ in range(2):
        idle.submit(serve.Job(r, enc, print))
    with pytest.raises(serve.ApiError) as e:
        idle.submit(serve.Job(r, enc, print))
    assert (e.value.status, e.value.kind) == (429, "rate_limit_error")


# ===== The command ================================================================================
def test_a_base_model_or_a_port_in_use_is_one_line(tmp_path):
    base = save_checkpoint(tiny_model(), tmp_path / "base.pt")
    r = run_cli("serve", "--checkpoint", base, "--port", "0")
    assert_one_line_error(r, base, "base model", "sft")
    assert_one_line_error(run_cli("serve", "--init_from", "gpt2"), "base model", "sft")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = run_cli("serve", "--checkpoint", base, "--port", str(taken.getsockname()[1]))
        assert_one_line_error(r, "cannot listen on 127.0.0.1 port", "--port")


def assert_port_free(host, port):
    """Nothing listens on the port, and a server started again listens there."""
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, port), timeout=HANG_LIMIT_S).close()
    serve.listen(host, port).close()


def test_ctrl_c_ends_the_server_and_frees_its_port(enc, capsys):
    engine = serve.Engine(chat_model(), enc)
    sock = serve.listen("127.0.0.1", 0)
    port = sock.getsockname()[1]

    def interrupt_once_served():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG_LIMIT_S)
        conn.request("GET", "/")
        assert b"<title>" in conn.getresponse().read()
        conn.close()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_served, daemon=True).start()
    assert serve.serve(engine, NAME, sock) == 0
    assert "stopped by SIGINT" in capsys.readouterr().out
    assert not engine.thread.is_alive()
    assert_port_free("127.0.0.1", port)


def test_sigterm_ends_the_server_mid_stream_and_frees_its_port(live):
    """Last: it ends the module's server."""
    conn = sse_request(live, {"messages": user("Hi!"), "stream": True,
                              "max_tokens": CONTEXT - 20, "temperature": 1.0})
    response = conn.getresponse()
    read_events(response, 2)
    live.proc.send_signal(signal.SIGTERM)
    assert live.proc.wait(HANG_LIMIT_S) == 0
    rest = response.read()
    conn.close()
    assert b'"code": "shutting_down"' in rest and rest.rstrip().endswith(b"data: [DONE]")
    assert "stopped by SIGTERM" in output(live.proc)[0]
    assert_port_free(live.host, live.port)
