"""jaxlm against PyTorch eager on this CPU, side by side: the same model, batch and optimizer step.

    python benchmarks/cpu_vs_torch.py                        # both shapes, both frameworks
    python benchmarks/cpu_vs_torch.py --shapes nanogpt --steps 100
    python benchmarks/cpu_vs_torch.py --jax-set model.scan_layers=false   # a jaxlm configuration to try
    python benchmarks/cpu_vs_torch.py --shapes llama34m --dtype float32   # both sides in float32

Shapes (issue 21, part 2):
- `nanogpt`: nanoGPT's own char-level Shakespeare CPU recipe (its README: 4 layers, width 128, 4 heads,
  context 64, batch 12, no dropout), GPT-2 style (LayerNorm, GELU MLP 4x, learned positions, biases,
  tied embedding), float32 as nanoGPT runs on a CPU.
- `llama34m`: a 33.6M-parameter Llama (width 512, 8 layers, 8 query and 4 key/value heads, SwiGLU 1536,
  vocab 8192, batch 8 x 256), bfloat16 compute (PyTorch: `torch.autocast("cpu", torch.bfloat16)`),
  float32 parameters.

`--profile N` also profiles N steps on each side and sets their time side by side by category
(matmuls, attention, copies and transposes, reductions, elementwise): XLA:CPU's thunks from
`jax.profiler` (benchmarks/profile_step.py, each kernel at its median launch), PyTorch's operators'
self time from `torch.profiler`. Each is the time an operation took from its start to its end, its
threads included (XLA:CPU may run independent thunks at once; PyTorch runs one operator at a time,
each on all its threads).

One optimizer step on each side is the same work: forward, cross-entropy, backward, global-norm
clipping to 1.0, AdamW (decay on matrices only), on one fixed batch of random tokens. The PyTorch model
is written here from the jaxlm variant's definition (pre-norm blocks, `F.scaled_dot_product_attention`
with a causal mask), eager, its default threads (one per core). Each side runs in its own process, one
after the other, so they never share the cores; the table gives the mean step over `--steps` steps after
`--warmup`, for each of `--repeats` alternating rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

SHAPES = {
    "nanogpt": dict(
        variant="gpt2", d_model=128, n_layers=4, n_heads=4, n_kv_heads=4, mlp_dim=512, vocab_size=65,
        seq_len=64, batch=12, dtype="float32", tie_embeddings=True,
    ),
    "llama34m": dict(
        variant="llama", d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, mlp_dim=1536, vocab_size=8192,
        seq_len=256, batch=8, dtype="bfloat16", tie_embeddings=False,
    ),
}


# ----------------------------------------------------------------------------------------------- jaxlm
def jax_overrides(shape: dict, extra: list[str]) -> list[str]:
    s = shape
    sets = [
        f"model.variant={s['variant']}", f"model.d_model={s['d_model']}", f"model.n_layers={s['n_layers']}",
        f"model.n_heads={s['n_heads']}", f"model.n_kv_heads={s['n_kv_heads']}", "model.head_dim=0",
        f"model.mlp_dim={s['mlp_dim']}", f"model.vocab_size={s['vocab_size']}", f"model.dtype={s['dtype']}",
        f"model.tie_embeddings={s['tie_embeddings']}", f"model.max_seq_len={s['seq_len']}",
        f"data.seq_len={s['seq_len']}", f"data.global_batch_size={s['batch']}",
        "optim.weight_decay=0.1", "optim.clip_norm=1.0", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1",
    ]
    return sets + list(extra)


def run_jax(shape: dict, extra: list[str], steps: int, warmup: int, profile: int = 0) -> dict:
    sys.path.insert(0, HERE)
    from train_throughput import bench  # noqa: PLC0415 (the jax side imports jax only in its own process)

    from jaxlm import config  # noqa: PLC0415
    from jaxlm.models.transformer import ModelConfig, param_count  # noqa: PLC0415

    overrides = dict(kv.split("=", 1) for kv in jax_overrides(shape, extra))
    r = bench("tiny", overrides, steps, warmup)
    cfg = config.load_recipe("tiny")
    config.apply_overrides(cfg, list(overrides.items()))
    import jax  # noqa: PLC0415

    out = {"step_ms": r["step_s"] * 1e3, "compile_s": r["compile_s"],
           "params": param_count(ModelConfig.from_config(cfg.model, log_choice=False))["total"],
           "version": f"jax {jax.__version__}"}
    if profile:
        import profile_step  # noqa: PLC0415

        p = profile_step.profile("tiny", overrides, 1, warmup, 0.0, 0, None, profiled=profile)
        out["profile_ms"] = {row["category"]: row["ms"] for row in p["categories"]}
    return out


TORCH_CATEGORIES = (  # PyTorch's operators by name, into profile_step.py's categories (first match)
    ("attention", r"scaled_dot_product|flash_attention|_efficient_attention"),
    ("matmuls", r"aten::(mm|addmm|bmm|matmul|baddbmm)$"),
    ("copies and transposes", r"aten::(copy_|clone|contiguous|cat|_to_copy|transpose|t|permute|index_select)$"),
    ("reductions (input fusions)", r"aten::(sum|mean|norm|linalg_vector_norm|_foreach_norm|max|amax|var)"),
    ("elementwise (loop fusions)", r""),
)


def torch_category(name: str) -> str:
    return next(label for label, pattern in TORCH_CATEGORIES if re.search(pattern, name))


# --------------------------------------------------------------------------------------------- PyTorch
def run_torch(shape: dict, steps: int, warmup: int, profile: int = 0) -> dict:
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415

    s = shape
    gpt2 = s["variant"] == "gpt2"
    d, h, kv = s["d_model"], s["n_heads"], s["n_kv_heads"]
    hd = d // h

    def norm() -> nn.Module:
        return nn.LayerNorm(d, eps=1e-5) if gpt2 else nn.RMSNorm(d, eps=1e-5)

    def rope(x: torch.Tensor) -> torch.Tensor:  # [b, heads, t, hd], rotate-half form
        t = x.shape[2]
        inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return (x * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = norm(), norm()
            self.q = nn.Linear(d, h * hd, bias=gpt2)
            self.kv = nn.Linear(d, 2 * kv * hd, bias=gpt2)
            self.o = nn.Linear(h * hd, d, bias=gpt2)
            if gpt2:
                self.fc, self.proj = nn.Linear(d, s["mlp_dim"]), nn.Linear(s["mlp_dim"], d)
            else:
                self.gate_up = nn.Linear(d, 2 * s["mlp_dim"], bias=False)
                self.down = nn.Linear(s["mlp_dim"], d, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            y = self.n1(x)
            q = self.q(y).view(b, t, h, hd).transpose(1, 2)
            k, v = self.kv(y).view(b, t, 2, kv, hd).unbind(2)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            if not gpt2:
                q, k = rope(q), rope(k)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != h)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, h * hd))
            y = self.n2(x)
            if gpt2:
                return x + self.proj(F.gelu(self.fc(y), approximate="tanh"))
            g, u = self.gate_up(y).chunk(2, -1)
            return x + self.down(F.silu(g) * u)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(s["vocab_size"], d)
            self.pos = nn.Embedding(s["seq_len"], d) if gpt2 else None
            self.blocks = nn.ModuleList(Block() for _ in range(s["n_layers"]))
            self.norm = norm()
            self.head = nn.Linear(d, s["vocab_size"], bias=False)
            if s["tie_embeddings"]:
                self.head.weight = self.embed.weight

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = self.embed(idx)
            if self.pos is not None:
                x = x + self.pos(torch.arange(idx.shape[1]))
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(self.norm(x)).float()
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    torch.manual_seed(0)
    model = Model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, s["vocab_size"], (s["batch"], s["seq_len"]), generator=g)
    tgt = torch.randint(0, s["vocab_size"], (s["batch"], s["seq_len"]), generator=g)
    autocast = s["dtype"] == "bfloat16"

    def step() -> float:
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss = model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    step_s = (time.perf_counter() - t0) / steps
    out = {"step_ms": step_s * 1e3, "compile_s": 0.0, "params": sum(p.numel() for p in model.parameters()),
           "version": f"torch {torch.__version__}, {torch.get_num_threads()} threads"}
    if profile:
        from torch.profiler import ProfilerActivity  # noqa: PLC0415
        from torch.profiler import profile as torch_profile  # noqa: PLC0415

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(profile):
                step()
        by_category: dict[str, float] = {}
        for op in prof.key_averages():
            if op.key.startswith("aten::") or op.key.startswith("Optimizer."):
                label = torch_category(op.key)
                by_category[label] = by_category.get(label, 0.0) + op.self_cpu_time_total / profile / 1e3
        out["profile_ms"] = {k: round(v, 3) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])}
    return out


# ----------------------------------------------------------------------------------------------- driver
def child(args: argparse.Namespace) -> None:
    shape = dict(SHAPES[args.shape], dtype=args.dtype or SHAPES[args.shape]["dtype"])
    r = run_torch(shape, args.steps, args.warmup, args.profile) if args.side == "torch" else run_jax(
        shape, args.jax_set, args.steps, args.warmup, args.profile)
    print("RESULT " + json.dumps(r))


def measure(side: str, shape: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", side, "--shape", shape,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--profile", str(args.profile),
           *(["--dtype", args.dtype] if args.dtype else []),
           "--jax-set", *args.jax_set]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{side} {shape} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def cpu_description() -> str:
    """This machine's processor, its cores, and the vector and bfloat16 extensions that decide CPU figures
    (from /proc/cpuinfo where there is one): the header of every CPU benchmark's table."""
    cpu, words = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), cpu)
        flags = next((ln for ln in lines if ln.split(":")[0].strip() in ("flags", "Features")), "")
        words = set(flags.split(":", 1)[-1].split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "sve", "bf16")
    return f"{cpu}, {os.cpu_count()} cores, flags: {' '.join(w for w in wanted if w in words) or 'none of these'}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2, help="alternating rounds of both sides")
    p.add_argument("--sides", nargs="+", default=["torch", "jax"], choices=["torch", "jax"])
    p.add_argument("--jax-set", nargs="*", default=[], metavar="KEY=VALUE", help="extra jaxlm config overrides")
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="the compute dtype of both sides (default: the shape's own)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile N steps on each side: the time by category, side by side")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--child", choices=["torch", "jax"], dest="side", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        child(args)
        return
    print(f"# {time.strftime('%Y-%m-%d')} | {cpu_description()} | python {platform.python_version()}"
          + (f" | dtype {args.dtype}" if args.dtype else "")
          + (f" | jaxlm overrides: {' '.join(args.jax_set)}" if args.jax_set else ""))
    rows = []
    for shape in args.shapes:
        for rep in range(args.repeats):
            for side in args.sides:
                r = measure(side, shape, args)
                rows.append({"shape": shape, "side": side, "round": rep + 1, **r})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print("| shape | side | round | params (M) | step (ms) | tokens/s | compile (s) | version |")
    print("|---|---|---|---|---:|---:|---:|---|")
    for r in rows:
        s = SHAPES[r["shape"]]
        tok = s["batch"] * s["seq_len"] / (r["step_ms"] / 1e3)
        print(f"| {r['shape']} | {r['side']} | {r['round']} | {r['params'] / 1e6:.2f} | {r['step_ms']:.1f} | {tok:,.0f} "
              f"| {r['compile_s']} | {r['version']} |")
    if args.profile:
        print(profile_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


def profile_table(rows: list[dict]) -> str:
    """Milliseconds per step by category, one column per measured (shape, side, round)."""
    columns = [r for r in rows if "profile_ms" in r]
    labels = list(dict.fromkeys(label for r in columns for label in r["profile_ms"]))
    lines = ["", "| ms per step, profiled | " + " | ".join(f"{r['shape']} {r['side']} {r['round']}" for r in columns) + " |",
             "|---|" + "---:|" * len(columns)]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(f"{r['profile_ms'].get(label, 0.0):.1f}" for r in columns) + " |")
    lines.append("| sum | " + " | ".join(f"{sum(r['profile_ms'].values()):.1f}" for r in columns) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
