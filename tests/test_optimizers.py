"""The optimizers: GPT-2's AdamW groups, --optimizer muon against a hand-built torch.optim.Muon +
AdamW, CombinedOptimizer's state dict, exact resume of Muon runs (from today's checkpoints and from
the older layout that kept the two optimizers apart). Muon in two processes (DDP and FSDP) is in
test_distributed.py."""
import io
import shutil

import pytest
import torch

import rundir
import settings
import train_gpt2 as tg
from helpers import (assert_one_line_error, dir_bytes, log_of, resume_args, run_args, run_cli,
                     tiny_model)

MUON = ["--optimizer", "muon"]
SMALL_VOCAB = dict(vocab_size=256, real_vocab_size=256)  # the blocks are what matters here


def test_configure_optimizers_groups_and_decay(capsys):
    model = tiny_model()
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-2, device_type="cpu")
    out = capsys.readouterr().out
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    n_decay = sum(p.numel() for p in decay["params"])
    assert f"decayed parameter tensors: {len(decay['params'])}, {n_decay:,} params" in out
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["eps"] == 1e-8
    assert not opt.defaults["fused"]
    # with zero gradients AdamW only decays: matmul weights shrink by lr*wd, biases and LN stay
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        if p.dim() >= 2:
            torch.testing.assert_close(p, before[n] * (1 - 1e-2 * 0.1))
        else:
            assert torch.equal(p, before[n]), n


def as_train_does(group):
    """A group's share of the schedule's LR, as train() sets it (Muon's and wte's own LRs)."""
    return group.get("lr_scale", 1.0)


def scheduled_steps(model, optimizers, x, scale_of, steps=4):
    """steps training steps of model on x, each optimizer group at the schedule's LR (warmup 2,
    cosine to step 4) times scale_of(group)."""
    for step in range(steps):
        lr = tg.get_lr(step, 1e-3, 1e-4, 2, 4)
        for o in optimizers:
            for group in o.param_groups:
                group["lr"] = lr * scale_of(group)
            o.zero_grad(set_to_none=True)
        model(x, x)[1].backward()
        for o in optimizers:
            o.step()


def reference_optimizers(model, wd, lr, muon_lr):
    """Built by hand from parameter names: Muon on every 2-D weight inside the blocks, AdamW with
    GPT-2's decay groups on everything else."""
    named = list(model.named_parameters())
    matrices = [p for n, p in named if n.startswith("transformer.h.") and p.dim() == 2]
    rest = [p for n, p in named if not (n.startswith("transformer.h.") and p.dim() == 2)]
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": wd},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=lr, betas=(0.9, 0.95), eps=1e-8)
    muon = torch.optim.Muon(matrices, lr=muon_lr, weight_decay=wd, momentum=0.9,
                            adjust_lr_fn="match_rms_adamw")
    return adamw, muon, muon_lr / lr


def test_muon_groups_match_hand_built_optimizers():
    ours, ref = tiny_model(seed=3, **SMALL_VOCAB), tiny_model(seed=3, **SMALL_VOCAB)
    opt = ours.configure_optimizers(0.1, 1e-3, "cpu", verbose=False,
                                    muon=dict(lr=3e-3, momentum=0.9))
    adamw, muon, ratio = reference_optimizers(ref, 0.1, 1e-3, 3e-3)
    assert [type(o) for o in opt] == [torch.optim.AdamW, torch.optim.Muon]
    assert len(opt.param_groups) == 3
    x = torch.randint(0, 256, (2, 32))
    scheduled_steps(ours, [opt], x, as_train_does)
    muon_group = muon.param_groups[0]
    scheduled_steps(ref, [adamw, muon], x, lambda group: ratio if group is muon_group else 1.0)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    moved = tiny_model(seed=3, **SMALL_VOCAB).transformer.h[0].mlp.c_fc.weight
    assert not torch.equal(moved, ours.transformer.h[0].mlp.c_fc.weight)  # not vacuous


@pytest.mark.parametrize("arch", ["gpt2", "modern"])
def test_embed_lr_matches_a_hand_built_adamw_with_wte_apart(arch):
    """--embed_lr: wte in an AdamW group of its own at embed_lr (tied, under --arch gpt2, the head
    with it), every other group as before: four scheduled steps bit for bit those of
    torch.optim.AdamW built by hand from parameter names."""
    parts = dict(**settings.ARCHITECTURES[arch], **SMALL_VOCAB)
    ours, ref = tiny_model(seed=3, **parts), tiny_model(seed=3, **parts)
    opt = ours.configure_optimizers(0.1, 1e-3, "cpu", verbose=False, embed_lr=5e-2)
    named = [(n, p) for n, p in ref.named_parameters() if n != "transformer.wte.weight"]
    groups = [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
              {"params": [ref.transformer.wte.weight], "weight_decay": 0.1}]
    adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-3, betas=(0.9, 0.95),
                              eps=1e-8)
    assert len(opt.param_groups) == len(adamw.param_groups)
    x = torch.randint(0, 256, (2, 32))
    scheduled_steps(ours, [opt], x, as_train_does)
    wte_group = adamw.param_groups[-1]  # at 5e-2 / 1e-3 = 50 times the schedule's LR
    scheduled_steps(ref, [adamw], x, lambda group: 50.0 if group is wte_group else 1.0)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name
    # not vacuous: without the flag wte takes other steps
    plain = tiny_model(seed=3, **parts)
    plain_opt = plain.configure_optimizers(0.1, 1e-3, "cpu", verbose=False)
    scheduled_steps(plain, [plain_opt], x, as_train_does)
    assert not torch.equal(plain.transformer.wte.weight, ours.transformer.wte.weight)


def test_embed_lr_on_a_checkpoint_trained_without_it_is_refused(reference, tmp_path):
    """The checkpoint's AdamW groups are the run's: --embed_lr given to a run trained without it
    (wte in the decayed group) is one line, before any work."""
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)
    before = dir_bytes(log)
    r = run_cli(*resume_args(log, "--embed_lr", "1e-2"))
    assert_one_line_error(r, "trained without --embed_lr", "resume without the flag")
    assert dir_bytes(log) == before


def test_embed_lr_0_is_none_and_a_checkpoint_with_one_keeps_it(data, tmp_path):
    """--embed_lr 0 turns the modern tiny preset's embedding group off: wte back in the decayed
    group, the groups of a run without the flag. A checkpoint trained with the group refuses 0 on
    resume, before any work."""
    flags = ["--arch", "modern", "--max_steps", "2", "--eval_every", "0", "--sample_every", "0"]
    groups = {}
    for name, extra in (("default", []), ("off", ["--embed_lr", "0"])):
        log = str(tmp_path / name)
        r = run_cli(*run_args(data, log, *flags, *extra))
        assert r.returncode == 0, r.stderr
        ckpt = torch.load(rundir.find_checkpoints(log)[-1], weights_only=True)
        groups[name] = ckpt["optimizer"]["param_groups"]
    assert groups["default"][-1]["params"] == ["transformer.wte.weight"]  # the preset's 3e-2
    assert "lr_scale" in groups["default"][-1]
    assert not any("lr_scale" in g for g in groups["off"]), groups["off"]
    assert "transformer.wte.weight" in groups["off"][0]["params"]  # decayed, with the matrices
    assert len(groups["off"]) == len(groups["default"]) - 1

    log = str(tmp_path / "default")
    before = dir_bytes(log)
    r = run_cli(*resume_args(log, "--embed_lr", "0", "--max_steps", "3"))
    assert_one_line_error(r, "trained with --embed_lr 0.03", "--embed_lr 0 asks for none",
                          "resume without the flag")
    assert dir_bytes(log) == before


@pytest.mark.slow  # three runs
def test_embed_lr_resume_is_exact(data, tmp_path):
    """A run with --embed_lr stopped after step 2 and resumed (the flag from its checkpoint, the
    group's lr_scale in it) ends as the run straight through does."""
    flags = ["--max_steps", "6", "--sample_every", "0", "--arch", "modern", "--embed_lr", "2e-2"]
    straight, log = str(tmp_path / "straight"), str(tmp_path / "log")
    for out, extra in ((straight, []), (log, ["--stop_step", "3"])):
        r = run_cli(*run_args(data, out, *flags, *extra))
        assert r.returncode == 0, r.stderr
    ckpt = torch.load(rundir.find_checkpoints(log)[-1], weights_only=False)
    groups = ckpt["optimizer"]["param_groups"]
    assert groups[-1]["params"] == ["transformer.wte.weight"], groups
    assert groups[-1]["lr_scale"] == pytest.approx(2e-2 / ckpt["args"]["max_lr"]), groups
    r = run_cli(*resume_args(log))
    assert r.returncode == 0, r.stderr
    assert log_of(straight) == log_of(log)


def test_combined_optimizer_state_dict_round_trip_is_exact():
    """state_dict() of AdamW + Muon, saved and loaded into a fresh CombinedOptimizer, gives the
    uninterrupted optimizer's next steps bit for bit."""
    x = torch.randint(0, 256, (2, 32))

    def steps(model, opt, n):
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            model(x, x)[1].backward()
            opt.step()

    def fresh(weights):
        model = tiny_model(seed=4, **SMALL_VOCAB)
        model.load_state_dict(weights)
        return model, model.configure_optimizers(0.1, 1e-3, "cpu", verbose=False, muon={})

    model = tiny_model(seed=3, **SMALL_VOCAB)
    opt = model.configure_optimizers(0.1, 1e-3, "cpu", verbose=False, muon={})
    assert isinstance(opt, tg.CombinedOptimizer) and len(opt.optimizers) == 2
    steps(model, opt, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    steps(model, opt, 3)  # the uninterrupted optimizer

    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    resumed, resumed_opt = fresh(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    steps(resumed, resumed_opt, 3)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    # not vacuous: the same weights with a fresh optimizer's state take other steps
    other, other_opt = fresh(saved["model"])
    steps(other, other_opt, 3)
    assert not torch.equal(other.transformer.h[0].mlp.c_fc.weight,
                           model.transformer.h[0].mlp.c_fc.weight)
    assert not torch.equal(other.transformer.wte.weight, model.transformer.wte.weight)


def test_adamw_stays_the_default_and_muon_flags_are_checked(data, tmp_path):
    assert settings.read_flags([])[0].optimizer == "adamw"
    assert isinstance(tiny_model().configure_optimizers(0.1, 1e-3, "cpu", verbose=False),
                      torch.optim.AdamW)
    r = run_cli(*run_args(data, str(tmp_path / "a"), *MUON, "--muon_momentum", "1.5"))
    assert assert_one_line_error(r) == \
        "error: argument --muon_momentum: must be in [0, 1), not 1.5 (see --help)"


# ------------------------------------------------------------------------------- resuming Muon runs

@pytest.fixture(scope="module")
def muon_runs(data, tmp_path_factory):
    """Six Muon steps straight, and the same run stopped after step 2: (straight, stopped)."""
    root = tmp_path_factory.mktemp("muon")
    flags = ["--max_steps", "6", "--sample_every", "0", *MUON, "--muon_lr", "4e-3"]
    straight, stopped = str(root / "straight"), str(root / "stopped")
    for log, extra in ((straight, []), (stopped, ["--stop_step", "3"])):
        r = run_cli(*run_args(data, log, *flags, *extra))
        assert r.returncode == 0, r.stderr
    return straight, stopped


def muon_names(ckpt):
    """The parameters Muon trains: the 2-D weights inside the blocks."""
    return {name for name, value in ckpt["model"].items()
            if name.startswith("transformer.h.") and value.dim() == 2}


@pytest.mark.slow  # several runs
def test_muon_resume_is_exact_and_checkpoints_hold_both_states(muon_runs, tmp_path):
    straight, stopped = muon_runs
    log = str(tmp_path / "log")
    shutil.copytree(stopped, log)
    ckpt = torch.load(rundir.find_checkpoints(log)[-1], weights_only=False)
    assert ckpt["args"]["optimizer"] == "muon"
    # one dict, keyed by parameter name, as torch.distributed.checkpoint keeps several optimizers
    assert set(ckpt["optimizer"]) == {"state", "param_groups"}
    state = ckpt["optimizer"]["state"]
    muon = muon_names(ckpt)
    assert muon and all(set(state[name]) == {"momentum_buffer"} for name in muon)
    assert set(state["transformer.wte.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert [g["lr_scale"] for g in ckpt["optimizer"]["param_groups"] if "lr_scale" in g] == [2.0]
    r = run_cli(*resume_args(log))
    assert r.returncode == 0, r.stderr
    assert log_of(straight) == log_of(log)
    # the wrong kind is refused in one line, before any work
    r = run_cli(*resume_args(log, "--optimizer", "adamw"))
    assert_one_line_error(r, "holds muon optimizer state but --optimizer adamw was given")


def old_muon_layout(ckpt):
    """ckpt["optimizer"] as Muon checkpoints once held it: {"adamw": ..., "muon": ...}, each what
    torch.distributed.checkpoint writes for one optimizer (state and param_groups by name)."""
    muon, merged = muon_names(ckpt), ckpt["optimizer"]
    parts = {kind: {"state": {}, "param_groups": []} for kind in ("adamw", "muon")}
    for name, state in merged["state"].items():
        parts["muon" if name in muon else "adamw"]["state"][name] = state
    for group in merged["param_groups"]:
        names = set(group["params"])
        assert names <= muon or not names & muon  # a group is one optimizer's
        parts["muon" if names <= muon else "adamw"]["param_groups"].append(group)
    return parts


def test_an_older_muon_checkpoint_resumes_exactly(muon_runs, tmp_path):
    straight, stopped = muon_runs
    log = str(tmp_path / "log")
    shutil.copytree(stopped, log)
    path = rundir.find_checkpoints(log)[-1]
    ckpt = torch.load(path, weights_only=False)
    ckpt["optimizer"] = old_muon_layout(ckpt)
    assert all(part["state"] and part["param_groups"] for part in ckpt["optimizer"].values())
    torch.save(ckpt, path)
    assert set(torch.load(path, weights_only=False)["optimizer"]) == {"adamw", "muon"}
    r = run_cli(*resume_args(log))
    assert r.returncode == 0, r.stderr
    assert log_of(straight) == log_of(log)


def test_checkpoint_without_optimizer_kind_is_adamw(reference, tmp_path):
    log = str(tmp_path / "log")
    shutil.copytree(reference, log)
    path = rundir.find_checkpoints(log)[0]
    ckpt = torch.load(path, weights_only=False)
    assert isinstance(ckpt["optimizer"]["state"], dict)  # AdamW's state dict as it always was
    del ckpt["args"]["optimizer"]  # as written before --optimizer existed
    torch.save(ckpt, path)
    r = run_cli("--resume", path, "--log_dir", log, "--device", "cpu", *MUON)
    assert_one_line_error(r, "holds adamw optimizer state but --optimizer muon was given")
    r = run_cli("--resume", path, "--log_dir", log, "--device", "cpu", "--stop_step", "4")
    assert r.returncode == 0, r.stderr
