#!/usr/bin/env python3
"""Greedy reference logits from Hugging Face transformers, to check tprun's decode against.

Loads a checkpoint folder with transformers (weights in --dtype on --device, no compilation,
the default dynamic KV cache), runs the prompt through the model, then generates --steps tokens
greedily, one forward per token. For each step i it records the full logits of the last position
(as float32) and their argmax: step 0 is the logits right after the prompt, step i the logits
after feeding the tokens of steps 0 .. i-1. The token of step i is argmax(logits[i]) (lowest id
on ties, as torch.argmax).

    python3 scripts/hf_reference.py --model /path/to/llama --prompt-ids "1,2,3" --steps 32 \\
        --out /tmp/hf_ref.npz [--dtype bf16|f32] [--device cuda|cpu]
    python3 scripts/hf_reference.py --model DIR --prompt-ids-file prompt.json --out ref.npz

--prompt-ids-file takes a JSON list of ints, a JSON object with "prompt_tokens" (as printed by
`tprun decode --json`) or "prompt", or ints separated by commas / whitespace.

Writes an .npz with tokens (int64 [steps]), logits (float32 [steps, vocab]) and prompt (int64
[prompt_len]); prints a one-line JSON summary (with the tokens) on stdout. Compare with tprun
using scripts/compare_logits.py. Needs torch, transformers and numpy (imported lazily, so --help
works without them).
"""
import argparse
import json
import sys
import time

from hf_load import load_model


def log(msg):
    print(f"[hf_reference] {msg}", file=sys.stderr, flush=True)


def parse_ids_text(text, what):
    """A JSON list, a JSON object with prompt_tokens/prompt, or comma/whitespace separated ints."""
    text = text.strip()
    if not text:
        raise ValueError(f"{what}: empty")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        obj = None
    if obj is None and "\n" in text:
        # JSON lines: take the last line that parses to something with prompt ids.
        for line in reversed(text.splitlines()):
            try:
                cand = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(cand, dict) and ("prompt_tokens" in cand or "prompt" in cand):
                obj = cand
                break
    if isinstance(obj, dict):
        for key in ("prompt_tokens", "prompt", "ids"):
            if key in obj:
                obj = obj[key]
                break
        else:
            raise ValueError(f"{what}: JSON object without prompt_tokens/prompt/ids")
    if isinstance(obj, list):
        ids = obj
    elif isinstance(obj, int) and not isinstance(obj, bool):
        ids = [obj]
    else:
        ids = [x for x in text.replace(",", " ").split()]
    try:
        out = [int(x) for x in ids]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: not a list of integers ({e})") from None
    if not out:
        raise ValueError(f"{what}: no ids")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Greedy reference logits from transformers (for comparing with tprun).")
    p.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", help='prompt token ids, e.g. "1,2,3"')
    src.add_argument("--prompt-ids-file",
                     help="file with the prompt ids: JSON list, JSON object with prompt_tokens, "
                          "or a comma list")
    p.add_argument("--steps", type=int, default=32, help="greedy steps to record (default 32)")
    p.add_argument("--out", required=True, help="output .npz file")
    p.add_argument("--dtype", choices=("bf16", "f32"), default="bf16",
                   help="weights dtype (default bf16)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="default cuda")
    p.add_argument("--attn", default="sdpa", help="attn_implementation (default sdpa)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    try:
        if args.prompt_ids is not None:
            args.prompt = parse_ids_text(args.prompt_ids, "--prompt-ids")
        else:
            with open(args.prompt_ids_file) as f:
                args.prompt = parse_ids_text(f.read(), args.prompt_ids_file)
    except (OSError, ValueError) as e:
        p.error(str(e))
    return args


def main(argv=None):
    args = parse_args(argv)
    import numpy as np
    import torch

    torch.set_grad_enabled(False)
    if args.device == "cuda" and not torch.cuda.is_available():
        log("CUDA is not available (use --device cpu)")
        return 2
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    dtype = {"bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
    log(f"loading {args.model} ({args.dtype}, {args.attn}) on {device} ...")
    t0 = time.perf_counter()
    model = load_model(args.model, dtype, device, args.attn, log=log)
    log(f"loaded in {time.perf_counter() - t0:.1f}s")

    emb_rows = model.get_input_embeddings().weight.shape[0]
    bad = [t for t in args.prompt if t < 0 or t >= emb_rows]
    if bad:
        log(f"prompt ids out of range [0, {emb_rows}): {bad[:8]}")
        return 2

    prompt = torch.tensor([args.prompt], dtype=torch.long, device=device)
    steps = args.steps
    tokens = np.zeros((steps,), dtype=np.int64)
    logits_rows = None
    past = None
    inp = prompt
    t0 = time.perf_counter()
    for i in range(steps):
        out = model(input_ids=inp, past_key_values=past, use_cache=True)
        past = out.past_key_values
        row = out.logits[0, -1, :].float()
        tok = int(torch.argmax(row).item())
        row_np = row.cpu().numpy().astype(np.float32, copy=False)
        if logits_rows is None:
            logits_rows = np.zeros((steps, row_np.shape[0]), dtype=np.float32)
        logits_rows[i] = row_np
        tokens[i] = tok
        inp = torch.tensor([[tok]], dtype=torch.long, device=device)
        if not np.all(np.isfinite(row_np)):
            log(f"warning: non-finite logits at step {i}")
    dt = time.perf_counter() - t0
    log(f"{steps} steps in {dt:.2f}s")

    # Through a file object, so that numpy does not append ".npz" to the name.
    with open(args.out, "wb") as f:
        np.savez(f, tokens=tokens, logits=logits_rows,
                 prompt=np.asarray(args.prompt, dtype=np.int64))
    log(f"wrote {args.out}")
    summary = {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "attn": args.attn,
        "prompt_len": len(args.prompt),
        "steps": steps,
        "vocab": int(logits_rows.shape[1]),
        "tokens": tokens.tolist(),
        "out": args.out,
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
