"""A run's numbers as it goes: the step line (loss, LR, gradient norm, time, tokens/s, MFU, memory,
ETA) on stdout, log.txt (written through rundir) and Weights & Biases, the run's summary at its end,
and torch.profiler over a few steps. Also the FLOPs a token costs and the GPUs' peak FLOP/s, which
the MFU and the plan command's time estimate share.
"""

import argparse
import math
import os
import re
import time

import torch

from common import UsageError
import rundir


# ===== The step line, log.txt and W&B ============================================================
# Peak dense bf16 FLOP/s (half NVIDIA's with-sparsity figures), fp16 for GPUs without bf16 (T4,
# V100: their datasheets' tensor-core figures), matched in order as substrings of the device name:
# SXM parts have no form factor in theirs, so NVL and PCIe come first.
PEAK_BF16_FLOPS = [("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),
                   ("H200 NVL", 835e12), ("H200", 989e12), ("A100", 312e12),
                   ("V100S", 130e12), ("V100-PCIE", 112e12), ("V100", 125e12), ("T4", 65e12)]


def peak_flops(device_name):
    """Peak dense bf16 FLOP/s of a GPU named like torch.cuda.get_device_name(), or None."""
    for key, flops in PEAK_BF16_FLOPS:
        if key.casefold() in device_name.casefold():
            return flops
    return None


def format_eta(seconds):
    """H:MM:SS, or from a day on "N days, H hours" (a CPU estimate of a full-size run is years)."""
    seconds = int(seconds)
    if seconds >= 86400:
        days, hours = seconds // 86400, seconds % 86400 // 3600
        return f"{days:,} day{'s' * (days != 1)}, {hours} hour{'s' * (hours != 1)}"
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def flops_per_token(config, n_params, seq_len):
    """Training FLOPs per token, forward + backward: 6N + 12·L·H·Q·T (PaLM, appendix B). n_params
    leaves out the lookups (wpe; wte unless it is the tied lm_head: GPT.get_num_params);
    12·L·H·Q·T are the attention matmuls."""
    L, H, Q, T = config.n_layer, config.n_head, config.n_embd // config.n_head, seq_len
    return 6 * n_params + 12 * L * H * Q * T


class Metrics:
    """Where a run's numbers go: the step line (loss, lr, norm, speed, MFU, memory, ETA) on stdout,
    log.txt on rank 0, and W&B with --wandb_project; at the end, the run's summary."""

    def __init__(self, run, proc, first_step, n_params):
        self.log_file, self.device = os.path.join(run.log_dir, "log.txt"), run.device
        self.world_size, self.master = proc.world_size, proc.master
        self.flops_per_token = flops_per_token(run.model, n_params, run.sequence_length)
        self.first_step, self.end = first_step, run.end_step
        self.show_batch = run.batch_ramp_tokens > 0
        self.on_cuda = run.device_type == "cuda"
        # a full-size run on a CPU takes days: said once, from the first steps' time
        self.warn_slow = run.device_type == "cpu" and run.preset != "tiny"
        self.peak = run.peak_flops

        # for the summary: this session's clock, steps and tokens; the whole run's evaluations and
        # skipped steps, a resumed run's earlier ones from its log.txt (already cut to its step)
        self.start, self.steps, self.tokens, self.last_step = time.time(), 0, 0, None
        self.evals = {"val": [], "val_bpb": [], "hella": [], "core": [], "chat": []}
        self.skipped, self.skipped_now = 0, 0
        if self.master and first_step > 0 and os.path.exists(self.log_file):
            earlier = rundir.read_log(self.log_file)
            for kind in self.evals:
                steps, values = earlier.get(kind, ([], []))
                self.evals[kind] = [(s, v) for s, v in zip(steps, values) if s < first_step]
            if "skipped" in earlier:
                self.skipped = int(earlier["skipped"][1][-1])

        self.wandb_run, self.dt_avg = None, None
        if run.wandb_project and self.master:
            try:
                import wandb
            except ImportError:
                message = "--wandb_project needs the wandb package: pip install wandb"
                raise UsageError(message) from None
            self.wandb_run = wandb.init(project=run.wandb_project, name=run.wandb_run_name,
                                        config=run.as_dict())

    def log(self, step, kind, value, **extra):
        """kind (train, val, hella, core, core/LABEL) to log.txt on rank 0, with the extra numbers
        that are log.txt kinds too (lr, norm, dt, ...); all to W&B, the extra ones as kind/name."""
        if kind in self.evals:
            self.evals[kind].append((step, value))
        if self.master:
            rundir.append_log(self.log_file, step, kind, value)
            for name, number in extra.items():
                if rundir.log_format(name) is not None:
                    rundir.append_log(self.log_file, step, name, number)
        if self.wandb_run is not None:
            extra = {f"{kind}/{k}": v for k, v in extra.items()}
            self.wandb_run.log({kind: value, **extra}, step=step)

    def report_val(self, step, loss, bpb=None):
        """The val loss's line and log entry; with bpb (bits per byte: val losses of two
        tokenizers compare) its line and entry too."""
        if self.master:
            print(f"validation loss: {loss:.4f}", flush=True)
        self.log(step, "val", loss)
        if bpb is not None:
            if self.master:
                print(f"validation bits per byte: {bpb:.4f}", flush=True)
            self.log(step, "val_bpb", bpb)

    def report_step(self, step, loss, lr, norm, dt, batch_size, skipped=False):
        """The step line and the step's numbers (dt in seconds, batch_size in tokens). skipped: the
        fp16 scaler found inf/nan gradients (norm) and did not apply this update."""
        tokens_per_sec = batch_size / dt
        self.steps, self.tokens, self.last_step = self.steps + 1, self.tokens + batch_size, step
        first_timed = False
        if step > self.first_step:  # the first step compiles and warms up: not in the ETA
            if self.dt_avg is None:
                self.dt_avg, first_timed = dt, True
            else:
                self.dt_avg = 0.9 * self.dt_avg + 0.1 * dt
        extra = {"lr": lr, "norm": norm, "dt": 1000 * dt, "tok_s": tokens_per_sec}
        line = f"step {step:5d} | loss {loss:.6f} | lr {lr:.4e} | norm {norm:.4f}"
        if skipped:  # log.txt keeps the run's count, the summary this session's
            self.skipped, self.skipped_now = self.skipped + 1, self.skipped_now + 1
            extra["skipped"] = self.skipped
            line += " | skipped (fp16 overflow)"
        line += f" | dt {dt * 1000:.2f}ms | tok/sec {tokens_per_sec:.0f}"
        if self.show_batch:
            line += f" | batch {batch_size}"
        if self.peak:
            extra["mfu"] = self.flops_per_token * tokens_per_sec / (self.peak * self.world_size)
            line += f" | mfu {100 * extra['mfu']:.1f}%"
        if self.on_cuda:
            extra["mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            line += f" | mem {extra['mem_gib']:.1f}GiB"
        eta = None
        if self.dt_avg is not None:
            eta = (self.end - step - 1) * self.dt_avg
            line += f" | eta {format_eta(eta)}"
        if self.master:
            print(line, flush=True)
            if first_timed and self.warn_slow and eta > 3600:
                print(f"warning: on the CPU this run takes about {format_eta(eta)} (from the "
                      f"first steps); for a run of minutes use --preset tiny", flush=True)
        self.log(step, "train", loss, **extra)

    def summary(self, last_checkpoint):
        """The run in a few lines, for its end: this session's wall time (from this object's
        making), steps and tokens; the final and best val loss and bits per byte, the last
        HellaSwag accuracy and CORE (a resumed run's earlier ones included); last_checkpoint (a
        path, or None); the skipped steps, if any."""
        trained = "no step trained"
        if self.steps:
            trained = (f"steps {self.first_step}-{self.last_step} ({self.steps:,} steps, "
                       f"{self.tokens:,} tokens)")
        lines = [f"run summary: {trained} in {format_eta(time.time() - self.start)}"]
        for kind, name in (("val", "val loss"), ("val_bpb", "val bits per byte")):
            if not self.evals[kind]:
                continue
            step, value = self.evals[kind][-1]
            line = f"  {name}: {value:.4f} at step {step}"
            finite = [(v, s) for s, v in self.evals[kind] if math.isfinite(v)]
            if finite:
                best, best_step = min(finite)
                line += f", best {best:.4f} at step {best_step}"
            lines.append(line)
        if self.evals["hella"]:
            step, value = self.evals["hella"][-1]
            lines.append(f"  HellaSwag acc_norm: {value:.4f} at step {step}")
        if self.evals["core"]:
            step, value = self.evals["core"][-1]
            lines.append(f"  CORE: {value:.4f} at step {step}")
        if self.evals["chat"]:
            step, value = self.evals["chat"][-1]
            lines.append(f"  chat tasks' centred mean: {value:.4f} at step {step}")
        lines.append(f"  last checkpoint: {last_checkpoint or 'none'}")
        if self.skipped_now:
            lines.append(f"  skipped steps (fp16 overflow): {self.skipped_now}")
        return "\n".join(lines)

    def finish(self):
        if self.wandb_run is not None:
            self.wandb_run.finish()


# ===== The profiler ==============================================================================
def profile_schedule(text):
    """argparse type of --profile_schedule: WAIT,WARMUP,ACTIVE steps."""
    if not re.fullmatch(r"\d+,\d+,0*[1-9]\d*", text):
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers WAIT,WARMUP,ACTIVE "
                                         f"(>= 0, >= 0, >= 1)")
    return text


class Profiler:
    """torch.profiler over a few training steps (--profile_schedule): a trace, then the top ops.
    Without --profile every call does nothing."""

    def __init__(self, run, proc):
        self.mode, self.steps_left, self.on_cuda = run.profile, 0, run.device_type == "cuda"
        self.master = proc.master
        if self.mode is None:
            return
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler
        wait, warmup, active = (int(v) for v in run.profile_schedule.split(","))
        activities = [ProfilerActivity.CPU]
        if self.on_cuda:
            activities.append(ProfilerActivity.CUDA)
        self.out = os.path.join(run.log_dir, "profile")
        handler = tensorboard_trace_handler(self.out, f"rank{proc.rank}")
        self.prof = profile(activities=activities, record_shapes=True, on_trace_ready=handler,
                            schedule=torch.profiler.schedule(wait=wait, warmup=warmup,
                                                             active=active, repeat=1))
        self.prof.start()
        self.steps_left = wait + warmup + active

    def step(self):
        """Call after each training step; True when the run should stop here (--profile exit)."""
        if self.mode is None or self.steps_left < 0:
            return False
        self.steps_left -= 1
        if self.steps_left >= 0:
            self.prof.step()
        if self.steps_left != 0:  # still recording
            return False
        self.steps_left = -1
        self.prof.stop()  # the trace handler wrote <log_dir>/profile/rank{r}.*.pt.trace.json
        if self.master:
            sort = "self_cuda_time_total" if self.on_cuda else "self_cpu_time_total"
            print(self.prof.key_averages().table(sort_by=sort, row_limit=20), flush=True)
            print(f"profiler trace in {self.out} (open in ui.perfetto.dev or TensorBoard)",
                  flush=True)
        return self.mode == "exit"
