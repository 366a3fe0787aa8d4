#!/usr/bin/env python3
"""Peer benchmark for tprun's GPU decode: greedy single-sequence decode with Hugging Face
transformers (PyTorch) on one GPU.

Loads a Llama-family checkpoint folder (bf16 safetensors) onto cuda:0 with
attn_implementation="sdpa", builds a fixed prompt of --prompt-len token ids (seeded
torch.Generator, ids in [1, vocab)), batch 1, and measures decode speed (tokens/s and
ms/token, prefill excluded) in one or more modes:

  compile  A hand-written greedy loop over a transformers StaticCache: the prompt is prefilled
           eagerly, then one decode step (model forward + argmax of the last logits) is wrapped in
           torch.compile(mode="reduce-overhead", fullgraph=True) (CUDA graphs; falls back to
           fullgraph=False, with a note on stderr, if the first compile fails). After a few
           warm-up steps the cache is reset and the prompt prefilled again; then --new-tokens
           steps are timed between two torch.cuda.synchronize() calls, each step's token feeding
           the next on the device (no host sync inside the loop). tok/s = new_tokens / seconds.
  static   model.generate(do_sample=False, cache_implementation="static") (recent transformers
           compile the decode forward by themselves in this case, with CUDA graphs; transformers
           5.x builds a new StaticCache in every generate() call, so the graphs are re-recorded on
           the first decode step of each call, and that cost is part of what this mode measures).
  eager    model.generate(do_sample=False) with the default dynamic cache, no compilation.

For static and eager, generate() is timed for N new tokens and for 1 new token (both with
min_new_tokens equal to max_new_tokens, so no early stop at EOS); the decode time per token is
(t(N) - t(1)) / (N - 1), which removes the prefill and setup. Each is run once untimed first
(compilation, allocator warm-up) and then --repeats times; the median is kept.

    python3 scripts/peer_hf_decode.py --model /path/to/llama --prompt-len 128 --new-tokens 256 \\
        --modes compile,static,eager [--json]

With --json, one JSON object per mode goes to stdout, one per line:
  {"peer": "transformers-<mode>", "tok_per_s": ..., "ms_per_token": ..., "prompt_len": ...,
   "new_tokens": ..., "first_tokens": [first 16 generated ids], ...}
Without it, a small table. Progress goes to stderr. Needs torch and transformers (imported lazily,
so --help works without them).
"""
import argparse
import inspect
import json
import statistics
import sys
import time

from hf_load import load_model

MODES = ("compile", "static", "eager")


def log(msg):
    print(f"[peer_hf_decode] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Greedy decode speed of Hugging Face transformers (peer of tprun decode).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="modes: compile (StaticCache + torch.compile reduce-overhead loop), "
               "static (generate with cache_implementation='static'), "
               "eager (generate with the dynamic cache)")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint folder (Llama family)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt length in tokens (default 128)")
    p.add_argument("--new-tokens", type=int, default=256,
                   help="decode steps / generated tokens to time (default 256)")
    p.add_argument("--modes", default="compile",
                   help="comma list of compile,static,eager (default compile)")
    p.add_argument("--json", action="store_true", help="print one JSON object per mode on stdout")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt ids (default 0)")
    p.add_argument("--device", default="cuda:0", help="torch device (default cuda:0)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed repetitions per mode; the median is reported (default 3)")
    p.add_argument("--compile-warmup", type=int, default=3,
                   help="untimed compiled decode steps before timing (default 3)")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes: unknown {bad}; choose from {','.join(MODES)}")
    args.modes = modes
    if args.prompt_len < 1:
        p.error("--prompt-len must be >= 1")
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.compile_warmup < 1:
        p.error("--compile-warmup must be >= 1")
    return args


# --------------------------------------------------------------------------------------------
# model loading and helpers


def vocab_size(model):
    v = getattr(model.config, "vocab_size", None)
    if not v:
        v = model.get_input_embeddings().weight.shape[0]
    return int(v)


def make_prompt(vocab, n, seed, device):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(1, vocab, (1, n), generator=g, dtype=torch.long)
    return ids.to(device)


def pad_token_id(model):
    gc = getattr(model, "generation_config", None)
    pid = getattr(gc, "pad_token_id", None) if gc is not None else None
    if pid is None:
        pid = getattr(model.config, "pad_token_id", None)
    if pid is None:
        eos = getattr(gc, "eos_token_id", None) if gc is not None else None
        if eos is None:
            eos = getattr(model.config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        pid = eos if eos is not None else 0
    return int(pid)


def forward_params(model):
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


# --------------------------------------------------------------------------------------------
# generate()-based modes: eager and static


def run_generate_mode(model, prompt, args, mode):
    import torch

    n = args.new_tokens
    attn_mask = torch.ones_like(prompt)
    extra = {}
    if mode == "static":
        extra["cache_implementation"] = "static"
    pad = pad_token_id(model)

    def gen(k):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(prompt, attention_mask=attn_mask, do_sample=False,
                             max_new_tokens=k, min_new_tokens=k, pad_token_id=pad, **extra)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    log(f"{mode}: warm-up generate({n}) (may compile)")
    t_warm, out = gen(n)
    log(f"{mode}: warm-up took {t_warm:.2f}s")
    gen(1)
    t_n, t_1 = [], []
    for r in range(args.repeats):
        a, out = gen(n)
        b, _ = gen(1)
        t_n.append(a)
        t_1.append(b)
        log(f"{mode}: repeat {r + 1}/{args.repeats}: generate({n}) {a:.3f}s, generate(1) {b:.3f}s")
    tn, t1 = statistics.median(t_n), statistics.median(t_1)
    gen_ids = out[0, prompt.shape[1]:].tolist()
    if len(gen_ids) != n:
        log(f"{mode}: warning: generate returned {len(gen_ids)} new tokens, expected {n}")
    dec = tn - t1
    if dec <= 0:
        raise RuntimeError(f"{mode}: generate({n}) was not slower than generate(1) "
                           f"({tn:.4f}s vs {t1:.4f}s); cannot separate decode time")
    ms = dec / (n - 1) * 1e3
    return {
        "peer": f"transformers-{mode}",
        "tok_per_s": 1e3 / ms,
        "ms_per_token": ms,
        "prompt_len": int(prompt.shape[1]),
        "new_tokens": n,
        "first_tokens": gen_ids[:16],
        "gen_n_s": tn,
        "gen_1_s": t1,
    }


# --------------------------------------------------------------------------------------------
# compile mode: StaticCache + torch.compile(reduce-overhead) decode step


def make_static_cache(model, max_len, device, dtype):
    from transformers.cache_utils import StaticCache

    cfg = model.config
    attempts = [
        # transformers 5.x (and late 4.x): layers allocate lazily on the first update
        dict(config=cfg, max_cache_len=max_len),
        # 4.4x-4.5x
        dict(config=cfg, max_batch_size=1, max_cache_len=max_len, device=device, dtype=dtype),
        # older 4.x
        dict(config=cfg, batch_size=1, max_cache_len=max_len, device=device, dtype=dtype),
    ]
    errors = []
    for kw in attempts:
        try:
            cache = StaticCache(**kw)
            log(f"compile: StaticCache({', '.join(kw)}) max_cache_len={max_len}")
            return cache
        except TypeError as e:
            errors.append(f"{sorted(kw)}: {e}")
    raise RuntimeError("could not construct StaticCache:\n  " + "\n  ".join(errors))


def reset_cache(cache):
    if hasattr(cache, "reset"):
        cache.reset()
        return True
    return False


def run_compile_mode(model, prompt, args):
    import torch

    device = prompt.device
    n = args.new_tokens
    plen = int(prompt.shape[1])
    max_len = plen + n
    dtype = next(model.parameters()).dtype
    cache = make_static_cache(model, max_len, device, dtype)
    params = forward_params(model)
    pass_cache_pos = "cache_position" in params
    if not pass_cache_pos:
        # transformers 5.x: the StaticCache keeps its own write position (a device tensor).
        log("compile: model.forward takes no cache_position (the cache tracks positions)")
    keep_kw = {}
    if "logits_to_keep" in params:
        keep_kw["logits_to_keep"] = 1
    elif "num_logits_to_keep" in params:
        keep_kw["num_logits_to_keep"] = 1

    def prefill():
        pos = torch.arange(plen, device=device, dtype=torch.long)
        kw = dict(input_ids=prompt, position_ids=pos.unsqueeze(0), past_key_values=cache,
                  use_cache=True, **keep_kw)
        if pass_cache_pos:
            kw["cache_position"] = pos
        out = model(**kw)
        return out.logits[:, -1, :].argmax(dim=-1)  # [1], on device

    def step(input_ids, position_ids, cache_position):
        kw = dict(input_ids=input_ids, position_ids=position_ids, past_key_values=cache,
                  use_cache=True)
        if pass_cache_pos:
            kw["cache_position"] = cache_position
        out = model(**kw)
        return out.logits[:, -1, :].argmax(dim=-1)

    mark_step = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)

    # Static per-step inputs, advanced in place on the device.
    in_ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    in_pid = torch.zeros((1, 1), dtype=torch.long, device=device)
    in_cpos = torch.zeros((1,), dtype=torch.long, device=device)
    buf = torch.zeros((n + 1,), dtype=torch.long, device=device)  # buf[0]: prefill's token

    def start():
        """(Re)prefill the prompt eagerly and point the step inputs at position plen."""
        reset_cache(cache)
        tok = prefill()
        buf.zero_()
        buf[0:1].copy_(tok)
        in_ids.copy_(tok.view(1, 1))
        in_pid.fill_(plen)
        in_cpos.fill_(plen)

    def run_steps(fn, first, count):
        """Steps first .. first+count-1; step i writes its token to buf[i + 1]."""
        for i in range(first, first + count):
            if mark_step is not None:
                mark_step()
            nxt = fn(in_ids, in_pid, in_cpos)
            # Copy out of the CUDA-graph output buffer before the next replay overwrites it.
            buf[i + 1:i + 2].copy_(nxt)
            in_ids.copy_(nxt.view(1, 1))
            in_pid.add_(1)
            in_cpos.add_(1)

    log(f"compile: eager prefill of {plen} tokens")
    start()
    warm = min(args.compile_warmup, n)
    fullgraph = True
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    t0 = time.perf_counter()
    try:
        log("compile: compiling the decode step (fullgraph=True) ...")
        run_steps(compiled, 0, 1)
    except Exception as e:  # noqa: BLE001 - any compile failure: retry without fullgraph
        first_line = (str(e).splitlines() or [""])[0]
        log(f"compile: fullgraph=True failed ({type(e).__name__}: {first_line}); "
            "retrying with fullgraph=False")
        fullgraph = False
        torch._dynamo.reset()
        start()
        compiled = torch.compile(step, mode="reduce-overhead", fullgraph=False)
        run_steps(compiled, 0, 1)
    torch.cuda.synchronize()
    log(f"compile: first compiled step took {time.perf_counter() - t0:.1f}s (fullgraph={fullgraph})")
    # The remaining warm-up steps (CUDA-graph recording and a first replay), continuing the
    # positions from the first step.
    run_steps(compiled, 1, warm - 1)
    torch.cuda.synchronize()
    log(f"compile: {warm} warm-up steps done")

    times = []
    first = None
    for r in range(args.repeats):
        start()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run_steps(compiled, 0, n)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        times.append(dt)
        ids = buf.tolist()
        if first is None:
            first = ids
        elif ids != first:
            log("compile: warning: generated tokens differ between repeats")
        log(f"compile: repeat {r + 1}/{args.repeats}: {n} steps in {dt:.4f}s "
            f"({n / dt:.1f} tok/s)")
    dt = statistics.median(times)
    # The generated sequence is the prefill's token followed by the n step tokens; the first 16
    # match generate()'s first 16 new tokens.
    return {
        "peer": "transformers-compile",
        "tok_per_s": n / dt,
        "ms_per_token": dt / n * 1e3,
        "prompt_len": plen,
        "new_tokens": n,
        "first_tokens": first[:16],
        "fullgraph": fullgraph,
        "decode_s": dt,
    }


# --------------------------------------------------------------------------------------------


def print_table(rows):
    print(f"{'peer':<22} {'prompt':>6} {'new':>5} {'ms/token':>9} {'tok/s':>9}  first tokens")
    for r in rows:
        toks = ",".join(str(t) for t in r["first_tokens"][:8])
        print(f"{r['peer']:<22} {r['prompt_len']:>6} {r['new_tokens']:>5} "
              f"{r['ms_per_token']:>9.3f} {r['tok_per_s']:>9.1f}  {toks}...")


def main(argv=None):
    args = parse_args(argv)
    import torch

    torch.set_grad_enabled(False)
    if not torch.cuda.is_available():
        log("CUDA is not available")
        return 2
    device = torch.device(args.device)
    torch.cuda.set_device(device)
    import transformers

    log(f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.cuda.get_device_name(device)}")
    log(f"loading {args.model} (bf16, sdpa) ...")
    t0 = time.perf_counter()
    model = load_model(args.model, torch.bfloat16, device, log=log)
    log(f"loaded in {time.perf_counter() - t0:.1f}s")
    vocab = vocab_size(model)
    prompt = make_prompt(vocab, args.prompt_len, args.seed, device)
    log(f"prompt: {args.prompt_len} ids in [1, {vocab}), seed {args.seed}; "
        f"new tokens {args.new_tokens}; modes {','.join(args.modes)}")

    rows = []
    failed = False
    for mode in args.modes:
        try:
            if mode == "compile":
                res = run_compile_mode(model, prompt, args)
            else:
                res = run_generate_mode(model, prompt, args, mode)
        except Exception as e:  # noqa: BLE001 - report and go on with the other modes
            log(f"{mode}: FAILED: {type(e).__name__}: {e}")
            failed = True
            continue
        log(f"{mode}: {res['tok_per_s']:.1f} tok/s, {res['ms_per_token']:.3f} ms/token")
        rows.append(res)
        if args.json:
            print(json.dumps(res), flush=True)
        torch.cuda.empty_cache()
    if not args.json:
        print_table(rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
