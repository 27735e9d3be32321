"""Fine-tuning on conversations: the rows ChatLoader packs (best fit, whole conversations, padding
never trained, one stream for any number of ranks, an exact resume), the conversations cut to the
context, and the step's loss as the mean over all its supervised tokens: K micro-steps of very
different supervised counts give the gradient of one forward over all their rows."""
import json
import os
import random

import numpy as np
import pytest
import torch

import chat
import train_gpt2 as tg
from helpers import tiny_model

WORDS = "the a river city water light plant red blue green small old new runs grows".split()


def conversations(n, seed=0, max_words=30):
    """n made-up conversations of 1 to 3 turns, some with a system message."""
    rng = random.Random(seed)

    def text():
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": text()}] if i % 3 == 0 else []
        for _ in range(rng.randint(1, 3)):
            msgs += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        out.append(msgs)
    return out


def arrays(convs, enc):
    """(ids, mask, starts) as the prepared data holds them: rendered, concatenated."""
    ids, mask, starts = [], [], [0]
    for msgs in convs:
        i, m = chat.render(msgs, enc)
        ids += i
        mask += m
        starts.append(len(ids))
    return (np.array(ids, dtype=np.uint16), np.array(mask, dtype=np.uint8),
            np.array(starts, dtype=np.int64))


@pytest.fixture(scope="module")
def data(enc):
    return arrays(conversations(120), enc)


def test_pack_rows_places_each_conversation_once_best_fit():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 60, 300)
    order = rng.permutation(300)
    rows = tg.pack_rows(lengths, order, 64, window=20)
    placed = [i for row in rows for i in row]
    assert sorted(placed) == list(range(300))
    assert all(row and sum(lengths[i] for i in row) <= 64 for row in rows)
    # best fit: within a row, each pick is the longest that fitted among those waiting
    assert any(len(row) > 1 for row in rows)


def test_conversations_cut_to_the_context_as_chat_crop_does(enc):
    convs = conversations(40, seed=1, max_words=60)
    ids, mask, starts = arrays(convs, enc)
    spans, note = tg.chat_spans(ids, mask, starts, 64)
    want, lost, total = [], 0, int(mask.sum())
    for k, msgs in enumerate(convs):
        i, m = chat.render(msgs, enc)
        cut = chat.crop(i, m, 64)
        if cut is None:
            lost += sum(m)
            continue
        want.append((int(starts[k]), len(cut[0]), sum(cut[1])))
        lost += cut[2]
    assert [tuple(s) for s in spans.tolist()] == want
    assert note is not None and f"{lost:,} of {total:,} supervised tokens" in note


def loader(data, B=3, T=64, rank=0, world=1, split="train"):
    return tg.ChatLoader(B, T, data, rank, world, split=split, seed=5, window=10)


def test_rows_train_the_assistant_only_and_pad_with_nothing_trained(data, enc):
    ld = loader(data)
    x, y = ld.next_batch()
    assert x.shape == y.shape == (3, 64)
    trained = y != -100
    assert trained.sum() == ld.mine_supervised > 0
    specials = set(y[trained].tolist()) & set(chat.SPECIAL_TOKENS.values())
    assert specials == {chat.END["assistant"]}  # the only special token trained
    row = torch.cat([x[0], y[0, -1:]])  # the row's T + 1 tokens
    assert row[0] == chat.EOT  # a row starts with a conversation


def test_two_ranks_see_the_rows_of_one(data):
    one = loader(data, B=4)
    two = [loader(data, B=2, rank=r, world=2) for r in range(2)]
    for _ in range(6):
        x1, y1 = one.next_batch()
        halves = [ld.next_batch() for ld in two]
        assert torch.equal(x1, torch.cat([h[0] for h in halves]))
        assert torch.equal(y1, torch.cat([h[1] for h in halves]))


def test_a_resumed_loader_continues_the_stream(data):
    a = loader(data)
    for _ in range(len(a.epoch_rows(0)) // 3 - 2):  # to the end of the first epoch
        a.next_batch()
    state = a.state_dict()
    b = loader(data)
    b.load_state_dict(state)
    for _ in range(5):
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert a.epoch >= 1  # the epochs' orders differ, and resume into them


def test_the_steps_loss_is_the_mean_over_all_its_supervised_tokens(data):
    """K micro-steps (losses divided by divisor()) give the gradient of one forward over all their
    rows, whose loss is the mean over all their supervised tokens: not the mean of the micro-
    steps' means. The micro-batches' supervised counts differ several-fold."""
    torch.manual_seed(0)
    model = tiny_model(real_vocab_size=chat.CHAT_VOCAB_SIZE)
    ld = loader(data, B=1, T=64)
    K = 4
    xs, ys, counts = [], [], []
    for k in range(K):
        x, y = ld.next_batch()
        d = ld.divisor(k, K)
        _, loss = model(x, y)
        (loss / d).backward()
        xs.append(x)
        ys.append(y)
        counts.append(int((y != -100).sum()))
    assert max(counts) > 1.5 * min(counts), counts
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _, loss = model(torch.cat(xs), torch.cat(ys))  # the plain reference: one big batch
    loss.backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-7)
    # the mean of the micro-steps' means would have been another gradient
    model.zero_grad()
    for x, y in zip(xs, ys):
        (model(x, y)[1] / K).backward()
    assert not all(torch.allclose(g, p.grad, rtol=1e-3, atol=1e-6)
                   for g, p in zip(got, model.parameters()))


# ===== The sft command: the one training loop, fine-tuning on conversations ======================
COLORS = {"river": "blue", "grass": "green", "sun": "yellow", "coal": "black"}


def color_talk(path):
    """The color of X? -> COLOR. A conversation a thing, one question each; the thing asked about
    comes last, next to the answer."""
    from helpers import write_jsonl

    write_jsonl(path, [{"messages": [{"role": "user", "content": f"The color of {thing}"},
                                     {"role": "assistant", "content": f"{color.capitalize()}."}]}
                       for thing, color in COLORS.items()])
    return str(path)


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory):
    """A base (not chat) checkpoint of a small model, as the sft command starts from."""
    from dataclasses import asdict

    model = tiny_model(n_layer=2, n_head=2, n_embd=64, block_size=64)
    path = tmp_path_factory.mktemp("sft_base") / "model.pt"
    torch.save({"model": model.state_dict(), "config": asdict(model.config)}, path)
    return str(path)


def sft_args(base_ckpt, tmp_path, *extra):
    return ["sft", "--init_from", base_ckpt, "--chat_data", color_talk(tmp_path / "talk.jsonl"),
            "--chat_dir", str(tmp_path / "chat"), "--log_dir", str(tmp_path / "log"),
            "--device", "cpu", "--dtype", "fp32", "-B", "4", "-T", "32",
            "--total_batch_size", "128", "--eval_every", "20", "--val_tokens", "64",
            "--save_every", "0", *extra]


def answer(model, enc, question, max_new=16):
    """The model's greedy reply to a question, and whether it ended with <|assistant_end|>."""
    ids = chat.render_prompt([{"role": "user", "content": question}], enc)
    out = model.generate(torch.tensor([ids]), max_new, top_k=1)[0, len(ids):].tolist()
    ended = chat.END["assistant"] in out
    if ended:
        out = out[: out.index(chat.END["assistant"])]
    return enc.decode([t for t in out if t < chat.EOT]), ended


@pytest.mark.slow
def test_a_small_model_learns_to_answer(base_ckpt, enc, tmp_path):
    """Format, mask and loss together: fine-tuned through the sft command, the model answers the
    questions of its train split and ends its turn. An inverted mask (the user's tokens trained)
    or an untrained end token fails this."""
    from helpers import run_cli

    r = run_cli(*sft_args(base_ckpt, tmp_path, "--max_steps", "80", "--max_lr", "1e-2"))
    assert r.returncode == 0, r.stderr
    ckpt = torch.load(tmp_path / "log" / "model_00079.pt", weights_only=True)
    model = tg.GPT(tg.GPTConfig(**ckpt["config"]))
    model.load_state_dict(ckpt["model"])
    assert chat.is_chat_model(model.config)
    train = chat.open_split(str(tmp_path / "chat"), "train")
    asked = []
    for i in range(len(train)):
        ids = train.conversation(i)[0].tolist()
        user = ids[ids.index(chat.START["user"]) + 1: ids.index(chat.END["user"])]
        asked.append(enc.decode(user).split()[-1])
    assert len(asked) >= 2
    for thing in asked:
        assert answer(model.eval(), enc, f"The color of {thing}") == \
            (f"{COLORS[thing].capitalize()}.", True), thing


@pytest.mark.slow
def test_a_resumed_sft_run_is_the_uninterrupted_one(base_ckpt, tmp_path):
    """Stopped after step 2 and resumed (with nothing but the log dir, as a pretraining run is),
    an sft run logs what it logs uninterrupted, to the bit."""
    from helpers import assert_same_log, resume_args, run_cli

    flags = ("--max_steps", "6", "--eval_every", "2", "--max_lr", "1e-2")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    r = run_cli(*sft_args(base_ckpt, whole, *flags))
    assert r.returncode == 0, r.stderr
    r = run_cli(*sft_args(base_ckpt, parts, *flags, "--stop_step", "3"))
    assert r.returncode == 0, r.stderr
    r = run_cli(*resume_args(str(parts / "log")))
    assert r.returncode == 0, r.stderr
    assert "sft=True" in r.stdout
    assert_same_log(str(whole / "log"), str(parts / "log"), tol=0)


@pytest.mark.slow
def test_two_ranks_fine_tune_as_one(base_ckpt, tmp_path):
    """torchrun, 2 processes (gloo) of -B 2 against 1 of -B 4: the same rows each micro-step, the
    step's loss the mean over all their supervised tokens, so the same run (to float order)."""
    from helpers import assert_same_log, run_cli, torchrun

    flags = ("--max_steps", "4", "--eval_every", "2", "--max_lr", "1e-2")
    one = sft_args(base_ckpt, tmp_path / "one", *flags)
    r = run_cli(*one)
    assert r.returncode == 0, r.stderr
    two = sft_args(base_ckpt, tmp_path / "two", *flags, "-B", "2")
    r = torchrun(*two)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_same_log(str(tmp_path / "one" / "log"), str(tmp_path / "two" / "log"), tol=1e-5)


@pytest.mark.slow
def test_the_chat_tasks_every_n_steps(base_ckpt, tmp_path, monkeypatch):
    """--chat_every: the chat tasks' centred mean and each task's in log.txt at step 0, every N
    and at the end; the last the same as the eval command gives of the final checkpoint."""
    from helpers import run_cli, series, write_chat_eval_data

    monkeypatch.setenv("CHAT_EVAL_DIR", write_chat_eval_data(str(tmp_path / "chat_eval")))
    r = run_cli(*sft_args(base_ckpt, tmp_path, "--max_steps", "4", "--chat_every", "2",
                          "--chat_max_per_task", "6", "--save_every", "4"))
    assert r.returncode == 0, r.stderr
    log = series(str(tmp_path / "log"))
    assert log["chat"][0] == [0, 2, 4]
    assert {k for k in log if k.startswith("chat/")} == {"chat/arc_easy", "chat/arc_challenge",
                                                         "chat/mmlu"}
    results = tmp_path / "results.json"
    r = run_cli("eval", "--tasks", "chat", "--checkpoint", str(tmp_path / "log" / "model_00003.pt"),
                "--device", "cpu", "--dtype", "fp32", "--max_per_task", "6", "--results",
                str(results))
    assert r.returncode == 0, r.stderr
    with open(results) as f:
        assert json.load(f)["centered_mean"] == pytest.approx(log["chat"][1][-1], abs=1e-4)


def test_every_row_trains_something(data):
    """Each row holds whole conversations, each with a trained token (its replies' ends at least):
    no micro-step is without supervised tokens, so none divides by zero."""
    ld = loader(data, B=1)
    for row in ld.epoch_rows(0):
        assert row and all(ld.spans[i, 2] > 0 for i in row)


@pytest.mark.slow
def test_a_modern_model_with_muon_fine_tunes_and_plan_answers(tmp_path, enc):
    """sft from a modern checkpoint (soft-capped head, the loss's own kernel) with Muon: the
    loss falls; plan --sft, once the data is prepared, counts the epoch's steps and writes
    nothing."""
    from dataclasses import asdict

    import settings
    from helpers import run_cli, series

    modern = {**settings.ARCHITECTURES["modern"], "zero_init": False}
    model = tiny_model(n_layer=2, n_head=2, n_embd=64, block_size=64, **modern)
    base = tmp_path / "modern.pt"
    torch.save({"model": model.state_dict(), "config": asdict(model.config)}, base)
    args = sft_args(str(base), tmp_path, "--optimizer", "muon", "--max_steps", "6",
                    "--eval_every", "0")
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    losses = series(str(tmp_path / "log"))["train"][1]
    assert losses[-1] < losses[0] - 0.3, losses
    listed = sorted(os.listdir(tmp_path))
    plan = [a for a in args if a not in ("--max_steps", "6")][1:]  # no --max_steps: one epoch
    r = run_cli("plan", "--sft", *plan)
    assert r.returncode == 0, r.stderr
    assert "sft: one epoch of the train conversations is" in r.stdout
    assert sorted(os.listdir(tmp_path)) == listed


@pytest.mark.slow
def test_an_sft_run_stops_when_it_diverges_and_takes_b_auto(base_ckpt, tmp_path):
    """The safety of pretraining's loop holds for fine-tuning: a huge LR stops the run before the
    update that diverged, in one line, with the last finite step saved; -B auto settles a
    micro-batch that fits (whatever this machine's memory makes it) and the run trains."""
    import rundir
    from helpers import run_cli

    r = run_cli(*sft_args(base_ckpt, tmp_path / "diverged", "--max_lr", "1e4",
                          "--max_steps", "20"))
    # stderr: the data's rendering progress, then the error's one line
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: step ") and "the run diverged and stopped before this " \
        "update" in line and line.endswith("continue with --resume latest"), line
    step = int(line.split("error: step ", 1)[1].split()[0])
    assert rundir.find_checkpoints(str(tmp_path / "diverged" / "log")) == [
        rundir.checkpoint_path(str(tmp_path / "diverged" / "log"), step - 1)]
    args = sft_args(base_ckpt, tmp_path / "auto", "--max_steps", "1")
    args[args.index("-B") + 1] = "auto"
    # a step of 64 rows of 32 tokens: -B auto picks a divisor of 64, all of it where it fits
    args[args.index("--total_batch_size") + 1] = str(64 * 32)
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert "-B auto: " in r.stdout and "sft=True" in r.stdout
