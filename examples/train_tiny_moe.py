"""Train a small decoder-only MoE language model twice: experts on distmoe, then on transformers'.

The model is a Hugging Face transformers Qwen3-MoE built from a config (attention, top-k
router, routed SwiGLU experts in every layer; no download), at one of two sizes:

* ``tiny``: hidden 32, 4 experts, top-2, expert FFN 32, 2 layers, 64 tokens a step: seconds
  a step on a CPU, where distmoe's kernels run in Triton's interpreter (the CI size);
* ``full``: the OLMoE expert shape (hidden 2048, 64 experts, top-8, expert FFN 1024) in 12
  layers with 8192 tokens a step (8 sequences of 1024): 5.0 B parameters (97 % in the
  experts, which do ~80 % of the FLOPs), to fill one 80 GB Hopper GPU: ~40 GB of bf16
  parameters, gradients and AdamW state, 10-20 GB of activations (``--layers`` and
  ``--batch`` change the size).

It is trained on text that the Python standard library ships (``pydoc_data.topics``, the
language reference's topics that ``help()`` prints, ~0.47 MB of English and code), read as
UTF-8 bytes: a byte-level tokenizer, vocabulary 256, nothing to download. Where that module
is missing, a generated corpus with learnable structure takes its place (the output says
which).

The same initial weights train twice with the same batches, learning-rate schedule and
AdamW (bf16 parameters, gradients and optimizer state): once with
``experts_implementation="distmoe"`` (distmoe.integrations.transformers), once with
transformers' ``"grouped_mm"`` (falls back to ``"eager"`` where the device has no grouped
matmul; the output says so). Outputs, in ``--out``:

* ``loss.png``: both loss curves, and each step's time;
* ``results.json``: device, date, command, versions, corpus, sizes, every step's loss and
  time per implementation, the median step time after warm-up, tokens per second, the
  ratio of step times and the final losses' relative difference;
* ``run-<implementation>.json``: each run's record, written as the run ends (a later run's
  failure keeps it). A distmoe run that runs out of GPU memory is recorded in
  ``results.json``'s ``failed_runs`` and the remaining runs go on.

distmoe runs over a torch.distributed process group, even at one rank: the script creates
a one-rank group (gloo on CPU, NCCL on CUDA) unless one exists. It runs on one rank only.

    python examples/train_tiny_moe.py --device cpu --size tiny --steps 100   # CPU, minutes
    python examples/train_tiny_moe.py --device cuda --size full --steps 300  # one GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import random
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

# distmoe is imported in main(), once the device is known: on --device cpu its kernels must run
# in Triton's interpreter even where a GPU is visible, which is chosen before they are defined.

VOCAB = 256  # byte-level tokenizer: one token per UTF-8 byte


@dataclass(frozen=True, kw_only=True)
class Size:
    """A model and batch size (Qwen3-MoE fields; every layer is an MoE layer)."""

    hidden: int
    ffn: int  # expert FFN width (moe_intermediate_size)
    num_experts: int
    top_k: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    batch: int  # sequences a step
    seq: int  # tokens a sequence
    lr: float  # peak learning rate (linear warm-up, cosine to a tenth)

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq


SIZES = {
    "tiny": Size(hidden=32, ffn=32, num_experts=4, top_k=2, layers=2, heads=2, kv_heads=1,
                 head_dim=16, batch=2, seq=32, lr=1e-2),
    "full": Size(hidden=2048, ffn=1024, num_experts=64, top_k=8, layers=12, heads=16, kv_heads=4,
                 head_dim=128, batch=8, seq=1024, lr=5e-4),
}
ROUTER_AUX_LOSS_COEF = 0.01  # load balancing (Qwen3-MoE's own auxiliary loss)


# ---------------------------------------------------------------------------- data
def _synthetic_corpus(num_bytes: int, seed: int) -> bytes:
    """Sentences from a small grammar plus sums with their results: local structure (words,
    agreement, digits that follow from the operands) that a byte-level model can learn."""
    rng = random.Random(seed)
    nouns = ["expert", "router", "token", "layer", "kernel", "tensor", "matrix", "gradient"]
    verbs = ["routes", "scales", "reads", "stores", "sums", "splits", "sends", "checks"]
    adjs = ["small", "sparse", "dense", "fast", "local", "remote", "quiet", "busy"]
    parts = []
    size = 0
    while size < num_bytes:
        if rng.random() < 0.7:
            s = (f"the {rng.choice(adjs)} {rng.choice(nouns)} {rng.choice(verbs)} "
                 f"the {rng.choice(nouns)}.\n")
        else:
            a, b = rng.randrange(100), rng.randrange(100)
            s = f"{a} + {b} = {a + b}\n"
        parts.append(s)
        size += len(s)
    return "".join(parts).encode()


def load_corpus(seed: int) -> tuple[str, bytes]:
    """``(description, UTF-8 bytes)``: the standard library's pydoc topics, else a generated
    corpus."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return ("synthetic: generated grammar sentences and sums (pydoc_data missing)",
                _synthetic_corpus(1 << 19, seed))
    text = "\n\n".join(topics[k] for k in sorted(topics))
    return (f"pydoc_data.topics of Python {platform.python_version()} (the standard "
            "library's language-reference topics)", text.encode())


def batch_starts(corpus_len: int, size: Size, steps: int, seed: int) -> torch.Tensor:
    """``[steps, batch]`` window starts, drawn once so that both runs see the same batches."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, corpus_len - size.seq, (steps, size.batch), generator=g)


# ---------------------------------------------------------------------------- setup
def init_one_rank(device: torch.device) -> bool:
    """A one-rank process group (gloo on CPU, NCCL on CUDA) unless one exists; whether it was
    created here. Raises ``ValueError`` for a group of more than one rank."""
    if dist.is_initialized():
        created = False
    else:
        if "RANK" in os.environ and "MASTER_ADDR" in os.environ:  # torchrun
            init_method = "env://"
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=init_method,
                                rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), **kwargs)
        created = True
    if dist.get_world_size() != 1:
        raise ValueError(f"this example runs on one rank; torch.distributed has "
                         f"{dist.get_world_size()} (expert parallelism: docs/integrations.md)")
    return created


def build_model(size: Size, device: torch.device, seed: int) -> torch.nn.Module:
    """The Qwen3-MoE causal LM of ``size`` in bf16 on ``device``, initialised from ``seed``
    (transformers' own init: N(0, 0.02^2) weights)."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=size.hidden, intermediate_size=4 * size.hidden,
        moe_intermediate_size=size.ffn, num_experts=size.num_experts,
        num_experts_per_tok=size.top_k, norm_topk_prob=True, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, num_key_value_heads=size.kv_heads,
        head_dim=size.head_dim, max_position_embeddings=size.seq, use_cache=False,
        output_router_logits=True, router_aux_loss_coef=ROUTER_AUX_LOSS_COEF,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16, experts_implementation="eager")
    return model.to(device).train()


def pick_baseline(device: torch.device) -> tuple[str, str]:
    """``(implementation, note)``: transformers' ``"grouped_mm"`` where a bf16 grouped
    matmul with gradients runs on ``device``, else ``"eager"`` (its per-expert loop)."""
    try:
        # shapes and group offsets aligned to 16 elements, as the CUDA kernel wants
        x = torch.randn(32, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(2, 64, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
        offs = torch.tensor([16, 32], device=device, dtype=torch.int32)
        mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
        y = mm(x, w, offs=offs)
        y.backward(torch.ones_like(y))  # a dense gradient (sum()'s is a stride-0 expand)
        return "grouped_mm", "transformers' grouped_mm experts (torch grouped matmul)"
    except Exception as exc:  # no kernel for this device / dtype: say so and go on
        return "eager", (f"transformers' eager experts (a loop over experts): grouped_mm "
                         f"failed on {device.type}: {type(exc).__name__}: {exc}")


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 10 % of the steps, cosine decay to a tenth of ``peak``."""
    warm = max(1, steps // 10)
    if step < warm:
        return peak * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------- training
def train(model: torch.nn.Module, impl: str, init_state: dict, data_V: torch.Tensor,
          starts: torch.Tensor, size: Size, warmup: int, device: torch.device,
          precision: str = "bf16") -> dict:
    """Train ``model`` from ``init_state`` with its experts on ``impl`` (distmoe's at
    ``precision``); losses and times."""
    from tqdm import tqdm

    import distmoe.integrations.transformers as dmt

    model.load_state_dict(init_state)
    if impl == "distmoe":
        options = dmt.ExpertsOptions(training_precision=precision)
        if not any(getattr(m, "distmoe_shard", None) for m in model.modules()):
            dmt.shard_experts(model, options=options)  # one rank: records the options
        else:
            dmt.set_options(model, options)
    model.set_experts_implementation(impl)
    if precision != "bf16":
        impl = f"{impl}-{precision}"
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=size.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=device.type == "cuda")
    offsets_S = torch.arange(size.seq, device=device)
    steps = starts.shape[0]
    losses, aux_losses, times = [], [], []
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    bar = tqdm(range(steps), desc=f"{impl:>10}", unit="step", mininterval=0.5,
               dynamic_ncols=True)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, size.lr)
        _sync(device)
        t0 = time.perf_counter()
        ids_BS = data_V[starts[step].to(device)[:, None] + offsets_S].long()
        out = model(input_ids=ids_BS, labels=ids_BS)
        out.loss.backward()  # language-model loss + ROUTER_AUX_LOSS_COEF * balance loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        aux = out.aux_loss.item()
        loss = out.loss.item() - ROUTER_AUX_LOSS_COEF * aux  # the language-model loss
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        aux_losses.append(aux)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{size.tokens_per_step / times[-1]:,.0f}")
    bar.close()
    median = statistics.median(times[warmup:])
    tail = max(1, steps // 10)
    result = {
        "implementation": impl,
        "init_checksum": checksum,
        "losses": losses,
        "router_aux_losses": aux_losses,
        "step_times_s": times,
        "median_step_s": median,
        "step_time_spread_s": [min(times[warmup:]), max(times[warmup:])],
        "tokens_per_s": size.tokens_per_step / median,
        "final_loss": losses[-1],
        "final_loss_mean_last_10pct": statistics.fmean(losses[-tail:]),
        "peak_memory_bytes": (torch.cuda.max_memory_allocated(device)
                              if device.type == "cuda" else None),
        "distmoe_contexts": len(dmt.cached_contexts()),
    }
    del optimizer, out
    dmt.close_contexts()  # frees distmoe's buffers before the next run (no-op for others)
    return result


def release_after_failure(model: torch.nn.Module, device: torch.device) -> None:
    """What a run that raised left behind: its gradients, distmoe's contexts, the cached
    blocks (the next run starts from the same memory as the first did)."""
    import distmoe.integrations.transformers as dmt

    for p in model.parameters():
        p.grad = None
    dmt.close_contexts()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def plot(path: Path, runs: list[dict], title: str, warmup: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(12, 4.5),
                                           gridspec_kw={"width_ratios": [3, 2]})
    colors = ("tab:red", "tab:orange", "tab:green", "tab:blue")
    for run, color in zip(runs, colors[:len(runs) - 1] + colors[-1:], strict=True):
        losses = run["losses"]
        steps = range(1, len(losses) + 1)
        smooth, ema = [], losses[0]
        for v in losses:  # exponential moving average, for the eye
            ema = 0.9 * ema + 0.1 * v
            smooth.append(ema)
        ax_loss.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
        ax_loss.plot(steps, smooth, color=color, linewidth=1.8,
                     label=f"{run['implementation']} (final {run['final_loss_mean_last_10pct']:.3f})")
        ax_time.plot(steps, [1e3 * t for t in run["step_times_s"]], color=color, linewidth=1,
                     label=f"{run['implementation']}: median {1e3 * run['median_step_s']:.1f} ms")
    ax_loss.set(xlabel="step", ylabel="training loss (nats per byte)", title="loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    ax_time.axvspan(0.5, warmup + 0.5, color="0.9", label="warm-up (not in the median)")
    ax_time.set(xlabel="step", ylabel="step time (ms)", yscale="log",
                title="step time (forward, backward, AdamW)")
    ax_time.grid(alpha=0.3, which="both")
    ax_time.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _git_sha() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=tuple(SIZES),
                        help="model size (default: full on cuda, tiny on cpu)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path,
                        help="output folder (default: examples/results/train_tiny_moe-SIZE-DEVICE)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, help="override the size's layer count")
    parser.add_argument("--batch", type=int, help="override the size's sequences per step")
    parser.add_argument("--precisions", nargs="+", default=["bf16"],
                        choices=("bf16", "mxfp8", "fp8_block"),
                        help="distmoe's training precisions, one run each (mxfp8: hidden and "
                             "ffn multiples of 32; fp8_block: of 128)")
    parser.add_argument("--hidden", type=int, help="override the size's hidden width")
    parser.add_argument("--ffn", type=int, help="override the size's expert FFN width")
    args = parser.parse_args(argv)
    size_name = args.size or ("full" if args.device == "cuda" else "tiny")
    size = SIZES[size_name]
    for name in ("layers", "batch", "hidden", "ffn"):
        value = getattr(args, name)
        if value is not None:
            if value < 1:
                parser.error(f"--{name} ({value}) must be >= 1")
            size = dataclasses.replace(size, **{name: value})
    if args.steps < 4:
        parser.error(f"--steps ({args.steps}) must be >= 4 (warm-up steps are not timed)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    out = args.out or Path(__file__).resolve().parent / "results" / \
        f"train_tiny_moe-{size_name}-{args.device}"
    out.mkdir(parents=True, exist_ok=True)

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels on the CPU
    import distmoe
    import distmoe.integrations.transformers as dmt  # registers the "distmoe" experts
    created_group = init_one_rank(device)
    try:
        corpus_name, corpus = load_corpus(args.seed)
        data_V = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).to(device)
        starts = batch_starts(len(corpus), size, args.steps, args.seed + 1)
        warmup = max(2, min(10, args.steps // 5))
        baseline, baseline_note = pick_baseline(device)
        device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                       else f"CPU ({platform.processor() or platform.machine()}, "
                            f"{torch.get_num_threads()} threads; Triton interpreter)")

        model = build_model(size, device, args.seed)
        num_params = sum(p.numel() for p in model.parameters())
        num_expert_params = sum(p.numel() for n, p in model.named_parameters()
                                if ".experts." in n)
        init_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        print(f"device: {device_name}\ncorpus: {corpus_name}, {len(corpus):,} bytes\n"
              f"model: Qwen3-MoE {size_name} ({num_params / 1e6:,.2f} M parameters, "
              f"{num_expert_params / num_params:.0%} in experts), {size}\n"
              f"baseline: {baseline_note}", flush=True)

        def finished(run: dict) -> dict:  # on disk as it ends: a later failure keeps it
            (out / f"run-{run['implementation']}.json").write_text(json.dumps(run) + "\n")
            return run

        runs, failed = [], {}
        for p in args.precisions:
            name = "distmoe" if p == "bf16" else f"distmoe-{p}"
            try:
                runs.append(finished(train(model, "distmoe", init_state, data_V, starts, size,
                                           warmup, device, precision=p)))
            except torch.OutOfMemoryError as exc:  # the other runs still tell something
                failed[name] = "out of GPU memory: " + str(exc).split(". ")[0]
            if name in failed:  # outside the handler: its traceback no longer holds tensors
                release_after_failure(model, device)
                print(f"{name}: {failed[name]}; going on with the next run", flush=True)
        if not runs:
            raise SystemExit(f"every distmoe run failed: {failed}")
        runs.append(finished(train(model, baseline, init_state, data_V, starts, size, warmup,
                                   device)))
        ours, base = runs[0], runs[-1]
        ratio = base["median_step_s"] / ours["median_step_s"]

        def rel_diff(run):
            return (abs(run["final_loss_mean_last_10pct"] - base["final_loss_mean_last_10pct"])
                    / base["final_loss_mean_last_10pct"])
        loss_diff = rel_diff(ours)
        results = {
            "device": device_name,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, *sys.argv] if argv is None
                                  else [sys.executable, __file__, *argv]),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__,
                         "triton": _version("triton"), "distmoe": distmoe.__version__,
                         "git": _git_sha()},
            "corpus": {"name": corpus_name, "bytes": len(corpus),
                       "tokenizer": "bytes (UTF-8), vocabulary 256"},
            "model": "Qwen3-MoE (transformers), bf16 parameters, AdamW (bf16 state), "
                     "grad-norm clip 1.0",
            "size_name": size_name,
            "size": dataclasses.asdict(size),
            "tokens_per_step": size.tokens_per_step,
            "num_parameters": num_params,
            "num_expert_parameters": num_expert_params,
            "steps": args.steps,
            "seed": args.seed,
            "warmup_steps": warmup,
            "baseline": baseline,
            "baseline_note": baseline_note,
            "runs": {r["implementation"]: r for r in runs},
            "failed_runs": failed,
            "speedup": ratio,
            "final_loss_rel_diff": loss_diff,
            "final_loss_rel_diff_by_run": {r["implementation"]: rel_diff(r) for r in runs},
        }
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        plot(out / "loss.png", runs,
             f"Qwen3-MoE {size_name}: D={size.hidden} E={size.num_experts} K={size.top_k} "
             f"F={size.ffn} L={size.layers}, {size.tokens_per_step} tokens/step, "
             f"{corpus_name.split(' (')[0]}; {device_name}", warmup)
        for r in runs:
            peak = r["peak_memory_bytes"]
            print(f"{r['implementation']:>10}: median step {1e3 * r['median_step_s']:9.2f} ms "
                  f"(steps {warmup + 1}-{args.steps}), {r['tokens_per_s']:12,.0f} tokens/s, "
                  f"loss {r['losses'][0]:.3f} -> {r['final_loss']:.3f} "
                  f"(mean of the last 10%: {r['final_loss_mean_last_10pct']:.3f})"
                  + (f", peak memory {peak / 2**30:.1f} GiB" if peak is not None else ""))
        note = ("" if device.type == "cuda" else
                " (CPU: distmoe's kernels run in Triton's interpreter, not a speed figure)")
        for r in runs[1:-1]:
            print(f"{r['implementation']}: final loss differs from {baseline}'s by "
                  f"{rel_diff(r):.2%}")
        print(f"step time {baseline} / distmoe: {ratio:.2f}x{note}; final losses differ by "
              f"{loss_diff:.2%}\nwrote {out / 'results.json'} and {out / 'loss.png'}")
        return results
    finally:
        dmt.close_contexts()
        if created_group:
            dist.destroy_process_group()


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
