"""bench.py runs on the CPU and reports every row (no timing is asserted)."""
import argparse
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import common
from helpers import HANG_LIMIT_S, REPO, assert_one_line_error, tiny_model


def bench(*args, timeout=HANG_LIMIT_S, cwd=REPO):
    return subprocess.run([sys.executable, os.path.join(REPO, "bench.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


@pytest.mark.slow
def test_bench_json_has_every_row(tmp_path):
    """Every row, long ones too, at the fewest steps and tokens that still give each its figures:
    one timed step, one round, one arch seed of one step of 2 x 64 tokens between two val passes
    of one batch, a fineweb row on the repository's docs, one example of each CORE task (the long
    row's on the tiny preset's shape). Rows of -T 128, one each (-B 1): at 64 about one
    SmolTalk-like conversation in 100,000 fits a row, and the sft row would build 150,000 of them
    to fill two. Run from a temporary dir: the save row writes where log/ would be, in the
    working directory."""
    docs = [os.path.join(REPO, doc) for doc in ("README.md", "docs/performance.md",
                                                "docs/operations.md")]
    r = bench("--preset", "tiny", "--device", "cpu", "-B", "1", "-T", "128", "--steps", "1",
              "--warmup", "0", "--gen_tokens", "4", "--hellaswag_examples", "4", "--long",
              "--rounds", "1", "--startup_shards", "2,3", "--startup_shard_tokens", "1000",
              "--arch_seeds", "1", "--arch_max_steps", "1", "--arch_eval_every", "1",
              "--arch_shape", "2,64", "--arch_val_tokens", "128", "--arch_input", *docs,
              "--fineweb_input", *docs,
              "--core_examples", "1", "--core_long_examples", "1", "--core_long_preset", "tiny",
              "--packing_conversations", "300", "--packing_lengths", "64", "--chat_turns", "3",
              "--tokenizer_chars", "20000", "--tokenizer_kind_chars", "30000",
              "--tokenizer_vocab", "300", "--tokenizer_bpb_steps", "1",
              "--serve_tokens", "8", "--json", cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["setting"]["device"] == "cpu" and out["setting"]["T"] == 128
    assert out["train"]["tokens_per_sec"] > 0 and out["train"]["tokens_per_step"] == 128
    # both architectures' step, alternated: their medians and ratio
    a = out["train_arch"]
    assert len(a["rounds_ms"]["gpt2"]) == len(a["rounds_ms"]["modern"]) == 1
    assert a["ratio"] == pytest.approx(a["modern_ms"] / a["gpt2_ms"]) and a["gpt2_ms"] > 0
    # through train_gpt2.main
    assert out["train_loop"]["ms_per_step"] > 0 and out["train_loop"]["tokens_per_step"] == 128
    # train() and the reference loop: the same init, data and schedule give the same losses
    parity = out["parity"]
    assert parity["steps_compared"] == 2 and parity["max_loss_diff"] < 1e-5
    rounds = parity["rounds_ms"]  # one round: the ratio of its two runs
    assert parity["ratio"] == pytest.approx(rounds["train_gpt2"][0] / rounds["reference"][0])
    startup = out["startup"]
    assert startup["shards"] == [2, 3] and set(startup["loader_s"]) == {"2", "3"}
    assert out["hellaswag"]["same_predictions"] and out["hellaswag"]["examples"] == 4
    for row in ("core", "core_gpt2"):  # CORE's 22 tasks, one example each, both ways alike
        core = out[row]
        assert core["same_results"] and core["examples"] == core["tasks"] == 22
        assert core["speedup"] == pytest.approx(core["one_per_forward"] / core["shared"])
    assert out["generate"]["kv_cache"] > 0 and out["generate"]["new_tokens"] == 4
    assert out["loader"]["us_per_batch"] > 0 and out["fineweb"]["tokens"] > 10_000
    assert out["save"]["seconds"] > 0 and 0.05 < out["save"]["gib"] < 0.2  # tiny: ~83 MiB
    # every arm trained on the same text from the same seed; the target is the first arm's end
    arch = out["arch"]
    recipes = [arch["runs"][arm][0] for arm in arch["arms"] if arm.startswith("gpt2_adamw")]
    first = min(recipes, key=lambda r: r["val"][-1])  # the better LR's run sets the target
    assert len(recipes) == 2 and arch["target_val"] == first["val"][-1]
    assert first["steps"] == [0, 1]
    assert arch["recipe_tokens"] == 128  # one step of --arch_shape's 2 x 64 tokens
    assert first["tokens_to_target"] == pytest.approx(128)  # reached at its last eval
    assert {r["val"][0] for r in arch["runs"]["gpt2_muon"] + recipes} == {first["val"][0]}
    # the modern head's N(0, 0.02) and zero bias: every logit near 0, the loss near the uniform's
    assert arch["runs"]["modern_muon"][0]["val"][0] == pytest.approx(math.log(50257), abs=0.1)
    # the count models at the same evaluations: before any count, the bigram is the uniform
    counts = arch["count_models"]
    assert len(counts["bigram"]) == len(counts["bigram_cache"]) == 2
    assert counts["bigram"][0] == pytest.approx(math.log(50257))
    # fine-tuning and chat: the SFT step against pretraining's, packing, time to first token
    assert out["sft"]["tokens_per_step"] == 128 and out["sft"]["ratio"] > 0
    assert set(out["packing"]["mixes"]) == {"smoltalk_like", "demo_chat"}
    assert 0 <= out["packing"]["mixes"]["demo_chat"]["64"]["padding_share"] < 1
    assert out["chat_ttft"]["turns"] == 3 and out["chat_ttft"]["same_first_tokens"]
    # the tokenizer rows (test_tokenizer_rows_... checks three): the tiny preset's val bpb with
    # GPT-2's BPE and a 300-token BPE of the same text, each its own held-out text's tokens
    bpb = out["tokenizer_bpb"]
    assert bpb["vocab_size"] == 300 and bpb["runs"]["gpt2"]["steps"] == 1
    assert bpb["tokens_per_step"] == 128  # -B 1 -T 128
    assert bpb["runs"]["own"]["train_tokens"] > bpb["runs"]["gpt2"]["train_tokens"]
    assert bpb["runs"]["own"]["val_tokens"] > bpb["runs"]["gpt2"]["val_tokens"]
    assert bpb["bpb_ratio"] == bpb["runs"]["own"]["val_bpb"] / bpb["runs"]["gpt2"]["val_bpb"]
    assert out["tokenizer_train"]["chars"] == 20_000
    # through the serve command: the engine's text, streamed to one client and to four at once
    assert out["serve"]["same_text"] and out["serve"]["reply_tokens"] == 8


def test_bench_names_the_rows_it_left_out(capsys):
    import bench
    assert bench.main(["--device", "cpu", "--only", "startup", "-B", "2", "-T", "64", "--rounds",
                       "1", "--startup_shards", "2,3", "--startup_shard_tokens", "1000"]) == 0
    out = capsys.readouterr().out
    assert "data start-up s, 2 / 3 shards" in out
    left = out.splitlines()[-1]
    assert left.startswith("not measured")
    assert ("--long adds train_arch and parity and train_loop and arch and core_gpt2 and sft and "
            "tokenizer_train and tokenizer_bpb") in left
    assert "; ".join(f"{k} ({v})" for k, v in bench.LONG_ROWS.items()) in left
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu", "--only", "train,nosuchrow"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and len(err.splitlines()) == 1
    assert err.startswith("error: argument --only: nosuchrow: no such row (rows: train,")


def test_headers_only_open_leaves_the_ids_to_the_reader(tmp_path):
    """The startup row's headers-only open: a bad id is found where a reader checks its window."""
    import bench

    import fineweb
    bench.write_sparse_shard(str(tmp_path / "a_train_000001.npy"), 5000)
    tokens = np.zeros(3000, dtype=np.uint16)
    tokens[1234] = 50300
    np.save(tmp_path / "a_train_000002.npy", tokens)
    paths, shards = fineweb.open_split(str(tmp_path), "train", None)
    assert [len(t) for t in shards] == [5000, 3000] and not shards[0].any()
    with pytest.raises(common.UsageError, match="token id"):
        fineweb.open_split(str(tmp_path), "train", 50257)  # the full check still reads them all
    fineweb.check_window(shards[1][:1234], 50257, paths[1])
    with pytest.raises(common.UsageError) as e:
        fineweb.check_window(shards[1][1000:2000], 50257, paths[1], 1000)
    assert str(e.value) == (f"{paths[1]}: token id 50300 at offset 1234 is >= the vocabulary "
                            f"size 50257")


@pytest.mark.slow
def test_bench_bad_device_is_one_line():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: --device cuda is not an error")
    r = bench("--device", "cuda", "--only", "train", timeout=HANG_LIMIT_S)
    assert_one_line_error(r, "--device")


def test_per_device_defaults_fill_only_the_flags_left_out():
    import bench
    args = bench.parse_args(["--device", "cpu"])
    target = bench.resolve(args)
    assert target.device_type == "cpu" and args.sequence_length == target.config.block_size
    for name, value in bench.DEVICE_DEFAULTS["cpu"].items():
        assert getattr(args, name) == value, name
    args = bench.parse_args(["--device", "cpu", "--compile", "-B", "3", "--steps", "7"])
    bench.resolve(args)
    assert args.compile and args.warmup == bench.COMPILED_WARMUP  # compiling: more warm-up
    assert (args.micro_batch_size, args.steps) == (3, 7)  # flags given win
    assert bench.parse_args(["--device", "cpu", "--compile", "--warmup", "0"]).warmup == 0
    block = target.config.block_size
    args = bench.parse_args(["--device", "cpu", "-T", str(block + 1)])
    with pytest.raises(common.UsageError, match=f"-T {block + 1} exceeds the tiny block size "
                                                f"{block}$"):
        bench.resolve(args)


def test_gpu_estimate_defaults_to_gpt2():
    import bench
    assert bench.parse_args(["--suite", "gpu-estimate"]).preset == "gpt2"
    assert bench.parse_args(["--suite", "gpu-estimate", "--preset", "tiny"]).preset == "tiny"
    assert bench.parse_args([]).preset == "tiny"


@pytest.mark.slow
def test_bench_optimizer_rows():
    import bench
    args = argparse.Namespace(micro_batch_size=2, sequence_length=32, warmup=0, steps=1)
    target = bench.Target(tiny_model().config, "cpu", common.autocast_for("fp32", "cpu")[0])
    row = bench.bench_optimizers(args, target)
    assert row["adamw_ms"] > 0 and row["muon_ms"] > 0
    assert row["muon_vs_adamw"] == row["muon_ms"] / row["adamw_ms"]


def test_resident_memory_is_none_where_neither_proc_nor_resource_exists(monkeypatch):
    """Windows: no /proc and no resource module; the loader row then shows n/a."""
    import builtins

    import bench
    real_open = builtins.open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    assert bench.rss_bytes() > 0
    monkeypatch.setattr(builtins, "open", no_proc)
    monkeypatch.setitem(sys.modules, "resource", None)
    assert bench.rss_bytes() is None and bench.fmt(None) == "n/a"


def test_tokens_to_reach_interpolates_between_evaluations():
    import bench
    steps, values = [0, 10, 20, 30], [10.0, 8.0, 6.0, 5.0]
    assert bench.tokens_to_reach(steps, values, 7.0, 100) == pytest.approx(1500)  # half way
    assert bench.tokens_to_reach(steps, values, 6.0, 100) == 2000  # reached exactly at step 20
    assert bench.tokens_to_reach(steps, values, 11.0, 100) == 0  # at init already
    assert bench.tokens_to_reach(steps, values, 4.0, 100) is None  # never


def kn_bigram_by_loops(train, a, b, vocab, discount, k):
    """The interpolated Kneser-Ney bigram's p(b | a), counted one pair at a time."""
    pairs = {}
    for x, y in zip(train[:-1], train[1:]):
        pairs[x, y] = pairs.get((x, y), 0) + 1
    context = sum(c for (x, _), c in pairs.items() if x == a)
    if context == 0:
        return (sum(1 for (_, y) in pairs if y == b) + k) / (len(pairs) + k * vocab)
    followers = sum(1 for (x, _) in pairs if x == a)
    lower = (sum(1 for (_, y) in pairs if y == b) + k) / (len(pairs) + k * vocab)
    pair = max(pairs.get((a, b), 0) - discount, 0) / context
    return pair + discount * followers / context * lower


@pytest.mark.parametrize("discount, k", [(0.5, 0.1), (0.9, 1.0), (0.95, 0.01)])
def test_kn_bigram_is_the_formula_and_a_distribution(discount, k):
    """Every pair's probability against the formula counted pair by pair, for seen and unseen
    contexts and targets; each context's probabilities sum to 1; no pair counted: the uniform."""
    import bench
    vocab = 7  # token 6 never appears; token 5 only last: a context never counted
    train = np.array([0, 1, 0, 1, 2, 0, 3, 3, 3, 1, 0, 4, 2, 1, 0, 5])
    a, b = np.repeat(np.arange(vocab), vocab), np.tile(np.arange(vocab), vocab)
    p = bench.kn_bigram_probs(train, a, b, vocab, discount, k)
    expected = [kn_bigram_by_loops(train.tolist(), x, y, vocab, discount, k)
                for x, y in zip(a.tolist(), b.tolist())]
    np.testing.assert_allclose(p, expected, rtol=1e-12)
    np.testing.assert_allclose(p.reshape(vocab, vocab).sum(1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(bench.kn_bigram_probs(train[:1], a, b, vocab, discount, k),
                               1 / vocab)


@pytest.mark.parametrize("n, T", [(12, 4), (13, 4), (5, 8)])
def test_window_cache_is_each_targets_share_of_its_windows_inputs(n, T):
    """Each target's share among the inputs of its window up to its own, as a model reads them
    in rows of T (the last row short when n is not a multiple of T)."""
    import bench
    stream = np.random.default_rng(n).integers(0, 3, n + 1)
    expected = []
    for j in range(n):
        context = stream[(j // T) * T: j + 1]
        expected.append((context == stream[j + 1]).sum() / len(context))
    np.testing.assert_allclose(bench.window_cache_probs(stream, T), expected)


def test_count_models_learn_a_repeating_text():
    """On a text that repeats one cycle, the counted bigram starts at the uniform's loss and ends
    near 0; the cache, which sees the cycle in each window, beats the uniform before any count."""
    import bench
    cycle = np.arange(10)
    train, val = np.tile(cycle, 50), np.tile(cycle, 4)[:33]
    curves = bench.count_model_curves(train, val, [0, 1, 2, 40], 10, 16, 1000)
    assert curves["bigram"][0] == pytest.approx(math.log(1000))
    assert curves["bigram"][0] > curves["bigram"][1] > curves["bigram"][2] > 0.1
    assert curves["bigram"][3] < 0.02  # 40 cycles counted: the next token all but certain
    assert curves["bigram_cache"][0] < math.log(1000) - 1


def test_count_models_read_the_tokens_the_runs_read(monkeypatch, tmp_path):
    """The train stream from its start across shards, as far as the last step reads, and the
    val's first targets with the token after the last."""
    import bench
    from helpers import write_shards

    train = np.concatenate(write_shards(tmp_path, "train", [50, 50, 50], seed=1))
    val = write_shards(tmp_path, "val", [40], seed=2)[0]
    got = {}

    def curves(train, val, steps, tokens_per_step, T, vocab):
        got.update(train=train, val=val)
        return {}

    monkeypatch.setattr(bench, "count_model_curves", curves)
    bench.count_models_on(str(tmp_path), range(4), 20, 8, 16)
    np.testing.assert_array_equal(got["train"], train[:61])  # 3 steps of 20, and the next
    np.testing.assert_array_equal(got["val"], val[:17])
    assert got["train"].dtype == np.int64


def test_arch_row_flags_reach_every_arms_run(monkeypatch, tmp_path):
    """--arch_lrs and --arch_warmup_steps replace each arm's own LRs and the preset's warmup in
    the command line each run gets (read back by train_gpt2's own flag parser); an arm's other
    flags stay, and the row records the LRs and warmup it ran with."""
    import bench
    import fineweb
    import settings

    runs = []

    def arch_run(flags, log_dir):  # one run's val curve, without training
        runs.append(settings.read_flags(flags)[0])
        return [0, 2], [10.0, 5.0], 1.0

    monkeypatch.setattr(bench, "arch_run", arch_run)
    monkeypatch.setattr(fineweb, "prepare", lambda *args, **kwargs: None)
    monkeypatch.setattr(bench, "count_models_on", lambda *args: {"bigram": [10.0] * 31})
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a text")
    args = bench.parse_args(["--device", "cpu", "--only", "arch", "--arch_seeds", "1",
                             "--arch_arms", "modern_cosine", "gpt2_muon_wsd", "--arch_target", "6",
                             "--arch_max_steps", "30", "--arch_warmup_steps", "5",
                             "--arch_lrs", "1e-2,5e-3,3e-2", "--arch_input", str(corpus)])
    row = bench.bench_arch(args, bench.resolve(args))
    assert [(r.arch, r.optimizer) for r in runs] == [("modern", "muon"), ("gpt2", "muon")]
    for r in runs:
        assert (r.max_lr, r.muon_lr, r.embed_lr, r.warmup_steps, r.max_steps) == \
            (1e-2, 5e-3, 3e-2, 5, 30)
    assert [r.wsd_decay for r in runs] == [0.0, 0.4]  # each arm's own schedule flag
    assert row["lrs"] == (1e-2, 5e-3, 3e-2) and row["warmup_steps"] == 5
    assert row["modern_cosine_tokens"] == pytest.approx(1.6 * 2048)  # 6: 4/5 of the way to step 2


@pytest.mark.parametrize("lrs", ["1e-2", "1e-2,5e-3,3e-2,1e-3", "1e-2,-5e-3"])
def test_arch_lrs_other_than_two_or_three_positive_numbers_are_one_line(lrs, capsys):
    import bench

    with pytest.raises(SystemExit) as e:
        bench.main(["--only", "arch", "--arch_lrs", lrs])
    assert e.value.code != 0
    err = capsys.readouterr().err
    assert err.startswith("error: argument --arch_lrs") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag, value", [("--startup_shards", "a,b"), ("--startup_shards", "1,5"),
                                         ("--startup_shards", "2,3,4"), ("--arch_shape", "0,64"),
                                         ("--arch_shape", "2")])
def test_integer_pairs_other_than_two_in_range_are_one_line(flag, value, capsys):
    """--startup_shards (each folder a val shard and a train shard at least) and --arch_shape:
    refused by the parser, before any row runs."""
    import bench

    with pytest.raises(SystemExit) as e:
        bench.main(["--only", "startup,arch", flag, value])
    assert e.value.code != 0
    err = capsys.readouterr().err
    assert err.startswith(f"error: argument {flag}: {value}: give") and \
        len(err.strip().splitlines()) == 1


# ----- the sft, packing and chat_ttft rows ------------------------------------------------------
def as_messages(ids):
    """A conversation's ids in render()'s layout back as messages, each content its token ids."""
    import chat

    role_of = {chat.START[role]: role for role in chat.ROLES}
    messages, content, role = [], [], None
    for token in ids[1:]:
        if token in role_of:
            role, content = role_of[token], []
        elif token == chat.END[role]:
            messages.append({"role": role, "content": content})
        else:
            content.append(int(token))
    return messages


class IdsEncoder:
    """An encoder for render() whose contents are token ids already."""

    @staticmethod
    def encode_ordinary(ids):
        return list(ids)


def test_smoltalk_like_conversations_are_rendered_as_chat_renders_them():
    import bench
    import chat

    ids, mask, starts = bench.smoltalk_like(60, seed=3)
    assert starts[0] == 0 and starts[-1] == len(ids) == len(mask)
    exchanges = set()
    for a, b in zip(starts[:-1], starts[1:]):
        messages = as_messages(ids[a:b].tolist())
        exchanges.add(len(messages) // 2)
        assert chat.problem([{**m, "content": "x"} for m in messages]) is None
        want_ids, want_mask = chat.render(messages, IdsEncoder)
        assert ids[a:b].tolist() == want_ids and mask[a:b].tolist() == want_mask
    assert exchanges == {1, 3}  # both kinds of conversation


def test_smoltalk_like_mix_has_the_published_lengths():
    """The four figures the mix was fitted to (nanochat's counts of smol-smoltalk), counted here
    from the arrays: the median length, the share longer than 513 tokens, and at rows of 513 the
    supervised tokens of the conversations that fit and of the first 513 tokens of the others,
    as shares of those in each conversation's first 2,048 tokens."""
    import bench

    ids, mask, starts = bench.smoltalk_like(20_000)
    lengths = np.diff(starts)
    cum = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])

    def within(n):  # each conversation's supervised tokens among its first n
        return cum[np.minimum(starts[:-1] + n, starts[1:])] - cum[starts[:-1]]

    total = within(2048).sum()
    fit = lengths <= 513
    assert np.median(lengths) == pytest.approx(858, rel=0.03)
    assert (~fit).mean() == pytest.approx(0.600, abs=0.015)
    assert within(513)[fit].sum() / total == pytest.approx(0.082, abs=0.005)
    assert within(513)[~fit].sum() / total == pytest.approx(0.399, abs=0.01)


def test_packing_stats_count_what_the_loader_gives():
    """The padding share is the share of the input positions that hold padding in the batches of
    one epoch (the conversations here start with another token than <|endoftext|>, so padding is
    the only one); the supervised share lost is what chat.crop cuts and drops, and what the
    batches' targets miss."""
    import bench
    import chat
    import train_gpt2 as tg

    ids, mask, starts = bench.smoltalk_like(300, seed=1)
    ids = ids.copy()
    ids[starts[:-1]] = 1  # no <|endoftext|> left
    T = 300
    stats = bench.packing_stats((ids, mask, starts), T)
    loader = tg.ChatLoader(1, T, (ids, mask, starts))
    rows = len(loader.epoch_rows(0))
    padding = targets = 0
    for _ in range(rows):
        x, y = loader.next_batch()
        padding += int((x == chat.EOT).sum())
        targets += int((y != -100).sum())
    assert loader.epoch == 1 and loader.row == 0  # one epoch exactly
    assert stats["rows"] == rows and stats["padding_share"] == padding / (rows * T)
    lost, dropped = 0, 0
    for a, b in zip(starts[:-1], starts[1:]):
        cropped = chat.crop(ids[a:b].tolist(), mask[a:b].tolist(), T + 1)
        dropped += cropped is None
        lost += int(mask[a:b].sum()) if cropped is None else cropped[2]
    assert 0 < dropped < 300 and 0 < lost  # cut and dropped conversations both counted
    assert stats["dropped"] == dropped and stats["cut"] > 0
    assert stats["lost_supervised_share"] == pytest.approx(lost / int(mask.sum()), abs=1e-12)
    assert stats["lost_supervised_share"] == pytest.approx(1 - targets / int(mask.sum()),
                                                           abs=1e-12)
    assert stats["trained_share"] == pytest.approx(targets / (rows * T), abs=1e-12)


def test_packing_row_packs_the_files_given(tmp_path, capsys):
    """--packing_input's conversations rendered as chat renders them: two that fill one row of
    T 64 together, the one bad row skipped with its note; the demo file and the synthetic mix
    beside them."""
    import bench
    import chat
    import fineweb

    talks = [[{"role": "user", "content": "Hi there, how are you?"},
              {"role": "assistant", "content": "Fine, thanks."}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"},
              {"role": "assistant", "content": "Because."}]]
    path = tmp_path / "talks.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in talks) + "not json\n")
    enc = fineweb.get_encoding()
    rendered = [chat.render(m, enc) for m in talks]
    ids, mask, starts = bench.render_files([str(path)])
    assert ids.tolist() == rendered[0][0] + rendered[1][0]
    assert mask.tolist() == rendered[0][1] + rendered[1][1]
    assert starts.tolist() == [0, len(rendered[0][0]), len(ids)]
    assert "1 bad row skipped, the first at line 3" in capsys.readouterr().err
    assert bench.main(["--device", "cpu", "--only", "packing", "--packing_conversations", "200",
                       "--packing_lengths", "64,8", "--packing_input", str(path), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["packing"]
    assert set(row["mixes"]) == {"smoltalk_like", "demo_chat", "input"}
    mine = row["mixes"]["input"]["64"]
    assert mine["rows"] == 1 and mine["padding_share"] == (64 - len(ids)) / 64
    assert mine["lost_supervised_share"] == 0 and mine["cut"] == mine["dropped"] == 0
    assert "error" in row["mixes"]["input"]["8"]  # not one first reply fits 9 tokens
    assert row["lengths"]["input"]["median_tokens"] == np.median(np.diff(starts))


def test_chat_ttft_row_turns_and_first_tokens():
    """Each turn's context grows by a turn of fixed size; the first token with the KV cache is
    the one a forward over the whole conversation gives, at every turn."""
    import bench

    args = bench.parse_args(["--device", "cpu", "--chat_turns", "6", "--rounds", "1"])
    target = bench.resolve(args)
    row = bench.bench_chat_ttft(args, target)
    user, reply = row["user_tokens"], row["reply_tokens"]
    assert (user, reply) == (19, 19)  # tiny: (255 // 6 - 4) tokens a turn, shared
    assert row["context_tokens"] == [1 + k * (user + reply + 4) + user + 3 for k in range(6)]
    assert row["same_first_tokens"]
    assert len(row["cached_ms"]) == len(row["recompute_ms"]) == 6
    assert row["speedup"] == row["recompute_ms"][-1] / row["cached_ms"][-1]
    assert row["last_rounds_ms"]["cached"] == [row["cached_ms"][-1]]
    assert row["new_tokens"] == user + 5 and row["head_ms"] > 0


def test_chat_turns_that_do_not_fit_are_one_line(capsys):
    import bench

    assert bench.main(["--device", "cpu", "--only", "chat_ttft", "--chat_turns", "100"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: 100 turns of") and len(err.strip().splitlines()) == 1
    assert bench.main(["--device", "cpu", "--only", "chat_ttft", "--chat_turns", "2",
                       "--chat_turn_tokens", "100,30"]) == 1  # 1 + 2 x 134 > 256
    assert "fewer --chat_turns" in capsys.readouterr().err


@pytest.mark.slow
def test_sft_row_steps_both_loaders():
    """Both arms time the same steps of the same shape; the SFT arm's rows are ChatLoader's (its
    supervised tokens fewer than the positions), with two micro-steps (divisor's path)."""
    import bench

    args = bench.parse_args(["--device", "cpu", "-B", "2", "-T", "128", "--grad_accum", "2",
                             "--steps", "1", "--warmup", "0", "--rounds", "2",
                             "--packing_conversations", "2000"])
    row = bench.bench_sft(args, bench.resolve(args))
    assert row["tokens_per_step"] == 2 * 128 * 2
    assert len(row["rounds_ms"]["sft"]) == len(row["rounds_ms"]["pretrain"]) == 2
    ratios = [p / s for s, p in zip(row["rounds_ms"]["sft"], row["rounds_ms"]["pretrain"])]
    assert row["ratio"] == pytest.approx(float(np.median(ratios)))
    assert row["sft_tokens_per_sec"] == pytest.approx(512 / row["sft_ms"] * 1000)
    assert 0 < row["supervised_per_step"] < 512
    assert row["sft_loader_ms"] > 0 and row["pretrain_loader_ms"] > 0
    assert row["rows_per_epoch"] >= 2 * 2 * 2  # no step packed a new epoch


def write_mo(path, translations, charset):
    """A gettext .mo file (GNU's layout, little-endian, no hash table) of translations
    {msgid: msgstr} (bytes), the header first, the entries sorted by msgid as msgfmt writes them."""
    import struct

    header = f"Content-Type: text/plain; charset={charset}\n".encode()
    entries = sorted({b"": header, **translations}.items())
    start = 28 + 16 * len(entries)  # the strings follow the header and the two tables
    tables, strings = [], b""
    for column in (0, 1):  # the msgids' table, then the msgstrs'
        for entry in entries:
            tables.append(struct.pack("<2I", len(entry[column]), start + len(strings)))
            strings += entry[column] + b"\0"
    head = struct.pack("<7I", 0x950412DE, 0, len(entries), 28, 28 + 8 * len(entries), 0, 0)
    path.write_bytes(head + b"".join(tables) + strings)


@pytest.mark.parametrize("charset", ["UTF-8", "ISO-8859-1"])
def test_mo_translations_are_what_gettext_reads(charset, tmp_path):
    """bench's reader of .mo files (the German text of the tokenizer rows) gives the translations
    Python's gettext reads from the same file: each plural form, in the header's charset."""
    import gettext

    import bench
    codec = "utf-8" if charset == "UTF-8" else "latin-1"
    translations = {b"Open file": "Datei \u00f6ffnen".encode(codec),
                    b"%d file\0%d files": "%d Datei\0%d Dateien".encode(codec),
                    b"Quit": "Beenden".encode(codec)}
    path = tmp_path / "de.mo"
    write_mo(path, translations, charset)
    with open(path, "rb") as f:
        catalog = gettext.GNUTranslations(f)._catalog
    want = sorted(text for msgid, text in catalog.items() if msgid != "")
    assert sorted(bench.mo_translations(str(path))) == want
    assert "Datei \u00f6ffnen" in want and len(want) == 4
    (tmp_path / "not.mo").write_bytes(b"not a catalog")
    assert bench.mo_translations(str(tmp_path / "not.mo")) == []


def test_tokenizer_rows_on_a_little_of_each_kind_of_text(capsys):
    """The tokenizer rows on 60,000 characters of each kind of text, 300-token BPEs: each text
    once, every tenth held out; the tokens encoded and the bytes per token on the held-out text
    counted again here with tiktoken's encodings (GPT-2's and each trained BPE's)."""
    import bench

    import fineweb
    assert bench.main(["--device", "cpu", "--only",
                       "tokenizer_train,tokenizer_encode,tokenizer_compression",
                       "--tokenizer_chars", "30000", "--tokenizer_kind_chars", "60000",
                       "--tokenizer_vocab", "300", "--rounds", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    train = out["tokenizer_train"]
    assert train["chars"] == 30_000 and train["vocab_size"] == 300
    assert train["chars_per_sec"] == train["chars"] / train["seconds"]
    gpt2 = fineweb.get_encoding()

    def tokens(enc, texts):
        return sum(len(enc.encode_ordinary(text)) for text in texts)
    for kind in ("english", "code", "german"):
        texts, held, tok = bench.kind_tokenizer(kind, 60_000, 300)  # the rows' own (kept)
        encoded, compressed = (out[row]["kinds"][kind]
                               for row in ("tokenizer_encode", "tokenizer_compression"))
        if not texts:  # no German translations on this system
            assert kind == "german" and encoded is None and compressed is None
            continue
        assert sum(map(len, texts)) == 60_000 and len(set(texts)) == len(texts)
        assert held == texts[::10] and tok.n_vocab == 300
        assert encoded["tokens"] == {"own": tokens(tok.encoding(), texts),
                                     "gpt2": tokens(gpt2, texts)}
        assert encoded["tokens_per_sec_ratio"] == pytest.approx(
            encoded["own_tokens_per_sec"] / encoded["gpt2_tokens_per_sec"])
        n_bytes = sum(len(text.encode()) for text in held)
        assert compressed["held_out_bytes"] == n_bytes
        assert compressed["own_bytes_per_token"] == n_bytes / tokens(tok.encoding(), held)
        assert compressed["gpt2_bytes_per_token"] == n_bytes / tokens(gpt2, held)
