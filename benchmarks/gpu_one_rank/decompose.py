"""Probe: where a GPU profile's excess over torch's runtime comes from (benchmarks/NOTES.md, finding 2, session 8).

Needs CUDA for the figures quoted there; ``--device cpu --smoke`` runs it anywhere in seconds.
Nothing is asserted; it prints and writes JSON (``--out``, default $OUT/decompose.json or /tmp).

For each model at the GPU sizes of benchmarks/gpu_one_rank, on one device, interleaved rounds of:
  eager     model fwd (sync) + bwd with ones (sync)
  gm        the exported graph module, the same
  chain     torch's pipeline() stage module (one stage) fwd+loss, bwd (StageChain)
  round_q   one profile round (all segment fwds, all bwds, accumulations) with NO sync per segment,
            timed as a whole (sync before and after)
  round_s   the same round with the profiler's Timer (sync per segment): sum of its parts AND wall
then: profile_segments sums (flush on / off), profile_loss, a one-stage 1F1B pipeline step at m=4
against the plan, and torch.profiler kernel time of eager vs a synced round.
"""
import argparse, json, os, statistics, subprocess, sys, time
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
import torch
import torch.distributed as dist
import autopipe
import autopipe.planning.profile as P
from autopipe.planning.trace import trace
from _pipebench import MODELS, ce_loss, make_target, stack_microbatches, StageChain, world_of_one
from autopipe.models.zoo import build

GPU_SIZES = {
    "seed_transformer": dict(vocab_size=32000, d_model=512, num_heads=8, d_ff=2048, num_layers=8, batch=8, seq_len=256),
    "gpt2_tied": dict(n_layer=8, n_embd=512, n_head=8, vocab_size=32000, batch=8, seq_len=256),
}


def one_round(rounds, timer, flush, accumulated):
    """One profile round as _time_in_rounds runs it, minus its setup (buffers, call_s): sum of timed parts."""
    from torch.utils._pytree import tree_leaves
    total = 0.0
    runs = []
    if flush is not None:
        flush()
    for module, make_inputs, _ in rounds:
        inputs = make_inputs()
        f, out = timer.time(lambda m=module, a=inputs: P._as_tuple(m.forward(*a)))
        runs.append((inputs, out)); total += f
    if flush is not None:
        flush()
    for k in reversed(range(len(rounds))):
        inputs, out = runs[k]
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [v for v in inputs if isinstance(v, torch.Tensor) and v.requires_grad] + rounds[k][2]
        if outs and wrt:
            b, got = timer.time(lambda: torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs], allow_unused=True))
            wg = got[len(got) - len(rounds[k][2]):] if rounds[k][2] else ()
            a = timer.time(lambda: P._accumulate(accumulated[k], wg))[0] if wg else 0.0
            total += b + a
            del got, wg
        runs[k] = None
    return total


class QueuedTimer(P.Timer):
    """Times nothing per call: lets a whole round be timed from outside."""
    def time(self, fn):
        return 0.0, fn()


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def wall(dev, fn):
    sync(dev); t0 = time.perf_counter(); fn(); sync(dev); return time.perf_counter() - t0


def smi():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as e:  # noqa
        return repr(e)


def kernel_ms(dev, fn):
    from torch.profiler import profile, ProfilerActivity
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    sync(dev)
    with profile(activities=acts) as prof:
        fn(); sync(dev)
    ka = prof.key_averages()
    dev_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in ka)
    n_k = sum(e.count for e in ka if (getattr(e, "self_device_time_total", 0) or 0) > 0)
    top = sorted(ka, key=lambda e: -(getattr(e, "self_device_time_total", 0) or 0))[:8]
    return dev_us / 1e3, n_k, [(e.key[:60], round(e.self_device_time_total / 1e3, 3), e.count) for e in top]


def probe(name, dev, opts, log):
    spec = MODELS[name]
    size = spec.smoke if opts.smoke else GPU_SIZES.get(name, spec.full) if dev.type == "cuda" else spec.full
    model, args = build(spec.zoo, **size)
    model = model.to(dev)
    args = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in args)
    with torch.no_grad():
        target = make_target(model(*args).float().cpu()).to(dev)
    traced = trace(model, args)
    gm = traced.graph_module
    log(f"== {name}: {len(traced.segments)} segments, {sum(p.numel() for p in model.parameters())/1e6:.1f}M params")

    captured = {}
    orig = P._time_in_rounds
    def spy(rounds, timer, warmup, repeats, flush=None, *rest):
        captured["rounds"], captured["flush"] = rounds, flush
        return orig(rounds, timer, warmup, repeats, flush, *rest)
    P._time_in_rounds = spy
    costs = P.profile_segments(traced, device=dev, warmup=2, repeats=opts.repeats, progress=False)
    P._time_in_rounds = orig
    rounds, flush = captured["rounds"], captured["flush"]
    costs_nf = P.profile_segments(traced, device=dev, warmup=2, repeats=opts.repeats, progress=False, flush_cache=False)
    loss = P.profile_loss(model, args, None, ce_loss, target, device=dev, warmup=2, repeats=opts.repeats)
    res = dict(model=name, segments=len(traced.segments))
    for tag, cs in (("profile", costs), ("profile_noflush", costs_nf)):
        res[tag] = dict(fwd=sum(c.fwd_s for c in cs), bwd=sum(c.bwd_s for c in cs), accum=sum(c.accum_s for c in cs))
    res["loss"] = dict(fwd=loss.fwd_s, bwd=loss.bwd_s)
    res["call_s"] = P._backward_call_s(P.Timer(dev))

    def fb(mod):
        def run():
            out = mod(*args)
            outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
            return outs
        def go():
            t_f, outs = P.Timer(dev).time(run)
            params = [p for p in model.parameters() if p.requires_grad]
            t_b, _ = P.Timer(dev).time(lambda: torch.autograd.grad(outs, params, [torch.ones_like(o) for o in outs],
                                                                   allow_unused=True))
            return t_f, t_b
        return go

    def fb_together(mod):
        def go():
            def run():
                out = mod(*args)
                outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
                params = [p for p in model.parameters() if p.requires_grad]
                torch.autograd.grad(outs, params, [torch.ones_like(o) for o in outs], allow_unused=True)
            return wall(dev, run)
        return go

    chain = StageChain(model, args, [], device=dev)

    def chain_go():
        f, b = chain.run_once(target)
        return f[0], b[0]

    accumulated = [[torch.zeros_like(p) for p in tr] for _, _, tr in rounds]

    def round_q():
        return wall(dev, lambda: one_round(rounds, QueuedTimer(dev), flush, accumulated))

    def round_s():
        t0 = time.perf_counter()
        total = one_round(rounds, P.Timer(dev), flush, accumulated)
        sync(dev)
        return total, time.perf_counter() - t0

    samples = {k: [] for k in ("eager_f", "eager_b", "eager_fb", "gm_f", "gm_b", "gm_fb", "chain_f", "chain_b",
                               "round_q", "round_s_sum", "round_s_wall", "flush2")}
    for i in range(opts.warm + opts.rounds):
        e = fb(model)(); g = fb(gm)(); ef = fb_together(model)(); gf = fb_together(gm)()
        c = chain_go(); q = round_q(); s_sum, s_wall = round_s()
        fl = wall(dev, lambda: (flush(), flush())) if flush is not None else 0.0
        if i >= opts.warm:
            samples["eager_f"].append(e[0]); samples["eager_b"].append(e[1]); samples["eager_fb"].append(ef)
            samples["gm_f"].append(g[0]); samples["gm_b"].append(g[1]); samples["gm_fb"].append(gf)
            samples["chain_f"].append(c[0]); samples["chain_b"].append(c[1])
            samples["round_q"].append(q); samples["round_s_sum"].append(s_sum); samples["round_s_wall"].append(s_wall)
            samples["flush2"].append(fl)
    res["samples_ms"] = {k: [round(x * 1e3, 3) for x in v] for k, v in samples.items()}
    res["median_ms"] = {k: round(statistics.median(v) * 1e3, 3) for k, v in samples.items()}
    res["mean_ms"] = {k: round(statistics.fmean(v) * 1e3, 3) for k, v in samples.items()}

    # kernel time: eager fwd+bwd vs a synced round vs a queued round
    res["kernels"] = {
        "eager_fb": kernel_ms(dev, lambda: fb_together(model)()),
        "round_synced": kernel_ms(dev, lambda: one_round(rounds, P.Timer(dev), flush, accumulated)),
        "round_queued": kernel_ms(dev, lambda: one_round(rounds, QueuedTimer(dev), flush, accumulated)),
    }
    # pipeline: one stage 1F1B m=4
    m = 4
    plan = autopipe.partition(model, 1, args, schedule="1F1B", n_microbatches=m, costs=costs, device=dev,
                              action_overhead_s=0.0, loss_fn=ce_loss, example_target=target, progress=False)
    pipe = autopipe.Pipeline(model, example_args=args, loss_fn=ce_loss, plan=plan, device=dev)
    batch, bt = stack_microbatches(args, m), torch.cat([target] * m)
    steps = []
    for i in range(3 + opts.rounds):
        for p in pipe.parameters():
            p.grad = None
        t = wall(dev, lambda: pipe.step(*batch, target=bt))
        if i >= 3:
            steps.append(t)
    res["pipe_step_ms"] = round(statistics.median(steps) * 1e3, 3)
    res["pipe_steps_ms"] = [round(x * 1e3, 3) for x in steps]
    res["plan_pred_ms"] = round(plan.predicted_step_s * 1e3, 3)
    res["kernels"]["pipe_step"] = kernel_ms(dev, lambda: pipe.step(*batch, target=bt))
    pipe = None  # free its stages before the next model
    pr = res["profile"]
    log(f"  profile sum fwd {pr['fwd']*1e3:.2f} bwd {pr['bwd']*1e3:.2f} accum {pr['accum']*1e3:.2f} | noflush "
        f"fwd {res['profile_noflush']['fwd']*1e3:.2f} bwd {res['profile_noflush']['bwd']*1e3:.2f} | loss "
        f"{loss.fwd_s*1e3:.2f}/{loss.bwd_s*1e3:.2f} | call_s {res['call_s']*1e6:.1f}us")
    log("  median ms: " + ", ".join(f"{k} {v}" for k, v in res["median_ms"].items()))
    log(f"  pipe 1F1B m={m}: step {res['pipe_step_ms']} ms (per mb {res['pipe_step_ms']/m:.2f}), plan {res['plan_pred_ms']} ms")
    for k, (ms, n, top) in res["kernels"].items():
        log(f"  kernels {k}: {ms:.2f} ms in {n} kernels; top {top[:4]}")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--models", nargs="*", default=["seed_transformer", "gpt2_tied"])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "decompose.json"))
    opts = ap.parse_args()
    dev = torch.device(opts.device)
    world_of_one(dev)
    log = lambda s: print(s, flush=True)
    log(f"torch {torch.__version__}; smi before: {smi()}")
    out = []
    for name in opts.models:
        out.append(probe(name, dev, opts, log))
        log(f"  smi: {smi()}")
        with open(opts.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
