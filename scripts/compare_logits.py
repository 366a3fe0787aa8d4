#!/usr/bin/env python3
"""Compares tprun's greedy-decode logits with the transformers reference from hf_reference.py.

Inputs:
  --tprun-logits FILE --vocab V  raw little-endian float32 [steps, V] as dumped by tprun: row i
                                 holds the logits that chose generated token i (row 0: the last
                                 prompt position after prefill).
  --tprun-json FILE              optional: the JSON printed by `tprun decode --json`; its "tokens"
                                 (or "token_ids") are tprun's generated ids, its "prompt_tokens"
                                 (or "prompt_ids"), when a list, the prompt. The file may hold other
                                 lines or several (also pretty-printed) objects: the last object
                                 with a tokens key is used. Without it, tprun's tokens are the
                                 argmax of its logits rows.
  --hf FILE.npz                  from scripts/hf_reference.py: tokens, logits, prompt.

For each step up to --steps, and up to and including the first step where the two greedy tokens
differ (later steps were computed from different contexts), it reports the cosine similarity of
the two logits rows (float64), the max abs difference, both argmaxes and each side's top-2 margin
(top-1 minus top-2 logit).

Verdict:
  PASS  the greedy tokens agree at every compared step and every cosine >= --min-cosine;
  PASS  (near-tie divergence) the tokens first differ at step s, every cosine up to and including
        s is >= --min-cosine, and step s is a near tie on both sides: with
        thr = max(0.05 * std(HF logits row s), 0.02), the HF top-2 margin and the tprun top-2
        margin are both < thr, and so are the gaps between the two chosen tokens on each side
        (HF logit of HF's token minus HF logit of tprun's token, and the same for tprun), so
        that the tokens each side picked are nearly tied on both sides;
  FAIL  otherwise (also when the prompts in the two files differ or the shapes do not fit).

Prints a table and a last line "compare: PASS" or "compare: FAIL (reason)"; exit status 0 or 1.
With --json, stdout holds just one JSON summary object (the table and the verdict line go to
stderr).

    python3 scripts/compare_logits.py --tprun-logits /tmp/tprun_logits.f32 --vocab 128256 \\
        --tprun-json /tmp/tprun.json --hf /tmp/hf_ref.npz --steps 32 --min-cosine 0.999 [--json]

Needs numpy only.
"""
import argparse
import json
import math
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Compare tprun's dumped logits with transformers' reference (hf_reference.py).")
    p.add_argument("--tprun-logits", required=True,
                   help="raw little-endian f32 logits file, [steps, vocab]")
    p.add_argument("--vocab", type=int, required=True, help="vocab size (row length) of that file")
    p.add_argument("--tprun-json", help="JSON output of `tprun decode --json` (tokens, prompt_tokens)")
    p.add_argument("--hf", required=True, help=".npz from hf_reference.py")
    p.add_argument("--steps", type=int, default=32, help="steps to compare at most (default 32)")
    p.add_argument("--min-cosine", type=float, default=0.999,
                   help="lowest acceptable cosine similarity per step (default 0.999)")
    p.add_argument("--json", action="store_true", help="print one JSON summary object on stdout")
    args = p.parse_args(argv)
    if args.vocab < 2:
        p.error("--vocab must be >= 2")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    return args


def int_list(v):
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return v
    return None


def json_objects(text):
    """Top-level JSON objects in text, in order: a whole-file object, objects one per line, or
    pretty-printed ones, mixed with other lines."""
    dec = json.JSONDecoder()
    out = []
    pos, n = 0, len(text)
    while pos < n:
        i = text.find("{", pos)
        if i < 0:
            break
        # Only try objects that start a line (after blanks); nested ones are skipped by jumping
        # past the end of a parsed object.
        line_start = text.rfind("\n", 0, i) + 1
        if text[line_start:i].strip():
            pos = i + 1
            continue
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            pos = i + 1
            continue
        if isinstance(obj, dict):
            out.append(obj)
        pos = end
    return out


def read_tprun_json(path):
    """(tokens, prompt or None) from the last object with tokens/token_ids."""
    with open(path) as f:
        text = f.read()
    for obj in reversed(json_objects(text)):
        toks = None
        for key in ("tokens", "token_ids", "generated_ids"):
            toks = int_list(obj.get(key))
            if toks is not None:
                break
        if toks is None:
            continue
        prompt = None
        for key in ("prompt_tokens", "prompt_ids"):
            prompt = int_list(obj.get(key))
            if prompt is not None:
                break
        return toks, prompt
    raise ValueError(f"{path}: no JSON object with a list of ints under 'tokens' (or 'token_ids')")


def json_safe(o):
    """NaN and infinities as null, so that the summary is strict JSON."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: json_safe(v) for k, v in o.items()}
    if isinstance(o, list):
        return [json_safe(v) for v in o]
    return o


def top2(row):
    """(argmax, top-1 minus top-2), argmax taking the lowest id on ties like torch/tprun."""
    import numpy as np

    a = int(np.argmax(row))
    if row.shape[0] < 2:
        return a, math.inf
    second = np.partition(row, -2)[-2]
    return a, float(row[a]) - float(second)


def main(argv=None):
    args = parse_args(argv)
    import numpy as np

    out = sys.stderr if args.json else sys.stdout
    summary = {"result": "FAIL", "reason": None, "steps_compared": 0, "divergence_step": None,
               "near_tie": False, "min_cosine_required": args.min_cosine, "rows": []}

    def finish(ok, reason):
        summary["result"] = "PASS" if ok else "FAIL"
        summary["reason"] = reason
        line = "compare: PASS" if ok else f"compare: FAIL ({reason})"
        if ok and reason:
            line += f" ({reason})"
        if args.json:
            print(json.dumps(json_safe(summary)), flush=True)
        print(line, file=out, flush=True)
        return 0 if ok else 1

    # --- inputs
    try:
        raw = np.fromfile(args.tprun_logits, dtype="<f4")
    except OSError as e:
        return finish(False, f"cannot read {args.tprun_logits}: {e}")
    if raw.size == 0 or raw.size % args.vocab:
        return finish(False, f"{args.tprun_logits}: {raw.size} floats is not a positive multiple "
                             f"of --vocab {args.vocab}")
    tp_logits = raw.reshape(-1, args.vocab)
    try:
        with np.load(args.hf) as z:
            hf_logits = np.asarray(z["logits"], dtype=np.float32)
            hf_tokens = [int(x) for x in np.asarray(z["tokens"]).reshape(-1)]
            hf_prompt = [int(x) for x in np.asarray(z["prompt"]).reshape(-1)] if "prompt" in z else None
    except Exception as e:  # noqa: BLE001 - missing file, not an npz, missing arrays
        return finish(False, f"cannot read {args.hf}: {type(e).__name__}: {e}")
    if hf_logits.ndim != 2:
        return finish(False, f"{args.hf}: logits have shape {hf_logits.shape}, expected 2-D")
    if hf_logits.shape[1] != args.vocab:
        return finish(False, f"vocab mismatch: tprun rows have {args.vocab} logits, "
                             f"HF rows {hf_logits.shape[1]}")

    tp_tokens, tp_prompt = None, None
    if args.tprun_json:
        try:
            tp_tokens, tp_prompt = read_tprun_json(args.tprun_json)
        except (OSError, ValueError) as e:
            return finish(False, str(e))
    if tp_prompt is not None and hf_prompt is not None and tp_prompt != hf_prompt:
        k = next((i for i, (a, b) in enumerate(zip(tp_prompt, hf_prompt)) if a != b),
                 min(len(tp_prompt), len(hf_prompt)))
        return finish(False, f"prompts differ (tprun {len(tp_prompt)} ids, HF {len(hf_prompt)}, "
                             f"first difference at index {k})")
    if tp_prompt is None and args.tprun_json:
        print("note: no prompt ids in the tprun JSON; prompts not checked", file=out)

    limits = {"--steps": args.steps, "tprun logits rows": tp_logits.shape[0],
              "HF logits rows": hf_logits.shape[0], "HF tokens": len(hf_tokens)}
    if tp_tokens is not None:
        limits["tprun tokens"] = len(tp_tokens)
    n = min(limits.values())
    if n < 1:
        return finish(False, "nothing to compare")
    if n < args.steps:
        short = ", ".join(f"{k} {v}" for k, v in limits.items() if v == n)
        print(f"note: comparing {n} steps (limited by {short})", file=out)

    # --- per step
    rows = []
    div = None
    self_mismatch = []
    for i in range(n):
        t = tp_logits[i].astype(np.float64)
        h = hf_logits[i].astype(np.float64)
        finite = bool(np.all(np.isfinite(t)) and np.all(np.isfinite(h)))
        nt, nh = float(np.linalg.norm(t)), float(np.linalg.norm(h))
        if finite and nt > 0 and nh > 0:
            cos = float(np.dot(t, h) / (nt * nh))
            max_abs = float(np.max(np.abs(t - h)))
        else:
            cos, max_abs = float("nan"), float("nan")
        t_arg, t_margin = top2(t)
        h_arg, h_margin = top2(h)
        t_tok = tp_tokens[i] if tp_tokens is not None else t_arg
        h_tok = hf_tokens[i]
        if tp_tokens is not None and t_tok != t_arg:
            self_mismatch.append(i)
        if h_tok != h_arg:
            print(f"note: step {i}: HF token {h_tok} is not the argmax {h_arg} of its logits",
                  file=out)
        r = {"step": i, "hf_token": h_tok, "tprun_token": t_tok, "hf_argmax": h_arg,
             "tprun_argmax": t_arg, "cosine": cos, "max_abs_diff": max_abs,
             "hf_margin": h_margin, "tprun_margin": t_margin, "hf_std": float(np.std(h))}
        rows.append(r)
        if t_tok != h_tok:
            div = i
            if 0 <= t_tok < args.vocab:
                # How far apart the two chosen tokens are on each side.
                r["hf_gap"] = float(h[h_tok] - h[t_tok])
                r["tprun_gap"] = float(t[t_tok] - t[h_tok])
            break
    summary["rows"] = rows
    summary["steps_compared"] = len(rows)
    summary["divergence_step"] = div
    cosines = [r["cosine"] for r in rows]
    summary["min_cosine_seen"] = min(cosines) if not any(math.isnan(c) for c in cosines) else None
    summary["max_abs_diff"] = max(r["max_abs_diff"] for r in rows)
    if self_mismatch:
        summary["tprun_token_not_argmax_steps"] = self_mismatch

    # --- table
    print(f"{'step':>4} {'hf_tok':>8} {'tp_tok':>8} {'cosine':>10} {'max_abs':>9} "
          f"{'hf_margin':>10} {'tp_margin':>10}", file=out)
    for r in rows:
        mark = "" if r["hf_token"] == r["tprun_token"] else "  <- differs"
        if not (r["cosine"] >= args.min_cosine):
            mark += "  <- low cosine"
        print(f"{r['step']:>4} {r['hf_token']:>8} {r['tprun_token']:>8} {r['cosine']:>10.6f} "
              f"{r['max_abs_diff']:>9.4f} {r['hf_margin']:>10.4f} {r['tprun_margin']:>10.4f}{mark}",
              file=out)
    if self_mismatch:
        print(f"note: tprun's tokens are not the argmax of its own logits rows at steps "
              f"{self_mismatch[:10]} (ties, or the dump does not line up with the tokens)", file=out)

    # --- verdict
    low = [r["step"] for r in rows if not (r["cosine"] >= args.min_cosine)]
    if low:
        worst = min(rows, key=lambda r: r["cosine"] if not math.isnan(r["cosine"]) else -2.0)
        return finish(False, f"cosine below {args.min_cosine} at steps {low[:10]} "
                             f"(lowest {worst['cosine']:.6f} at step {worst['step']})")
    if div is None:
        return finish(True, None)
    r = rows[div]
    thr = max(0.05 * r["hf_std"], 0.02)
    gaps_known = "hf_gap" in r
    near = (r["hf_margin"] < thr and r["tprun_margin"] < thr and gaps_known
            and r["hf_gap"] < thr and r["tprun_gap"] < thr)
    desc = (f"step {div}: HF token {r['hf_token']} margin {r['hf_margin']:.4f}, tprun token "
            f"{r['tprun_token']} margin {r['tprun_margin']:.4f}")
    if gaps_known:
        desc += f", gaps HF {r['hf_gap']:.4f} / tprun {r['tprun_gap']:.4f}"
    desc += f", near-tie threshold {thr:.4f}"
    if near:
        summary["near_tie"] = True
        print(f"near-tie divergence at step {div} (HF margin {r['hf_margin']:.4f}, tprun margin "
              f"{r['tprun_margin']:.4f}, threshold {thr:.4f})", file=out)
        return finish(True, f"near-tie divergence at step {div}")
    return finish(False, f"greedy tokens diverge at {desc}")


if __name__ == "__main__":
    sys.exit(main())
