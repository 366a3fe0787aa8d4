#!/usr/bin/env python3
"""Builds a tiny Qwen3.5 (gated DeltaNet hybrid) with transformers itself and writes the
fixture tprun's tests check against without Python (issue 11).

    python3 scripts/ref_qwen35.py OUT_DIR

writes, under OUT_DIR:
  qwen35-tiny/        config.json, model.safetensors (bf16, from transformers' own
                      save_pretrained), reference.json
  qwen35-tiny-gptq/   the same model with its MLP quantized to GPTQ int4 (sym, group 32,
                      zeros stored in the v1 `gptq` convention: z − 1 = 7), config.json with
                      quantization_config, model.safetensors, reference.json: transformers'
                      output on the dequantised twin ((q − z)·s exactly, in f32)

reference.json: the prompt, the greedy tokens, the logits of every step (step 0 is the
prompt's last position; step i the logits after feeding greedy token i − 1), each step's
top-1 − top-2 margin (a step with a tiny margin may legitimately differ), and the versions.

The model is run in f32 from the bf16-rounded weights (so tprun, reading the bf16 file and
computing in f32, should match to ~1e-5), without a cache: every step is a full forward pass
of the sequence so far, which exercises transformers' chunked DeltaNet prefill path.

Weights are drawn so that logits are O(1) (transformers' 0.02 initialisation gives
near-ties everywhere): linears N(0, 1/in), embeddings N(0, 1), zero-centred norms N(0, 0.1),
A_log = log U(1, 16), dt_bias N(0, 0.5), conv N(0, 0.5).
"""

import json
import math
import os
import sys

import torch

VOCAB = 256
PROMPT = [1, 17, 42, 99, 3, 250, 7, 64, 128, 5]
STEPS = 12
GROUP = 32


def config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=12,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        bos_token_id=1,
        eos_token_id=2,
    )


def init(model):
    g = torch.Generator().manual_seed(35)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                v = torch.log(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g))
            elif name.endswith("dt_bias"):
                v = torch.randn(p.shape, generator=g) * 0.5
            elif "conv1d" in name:
                v = torch.randn(p.shape, generator=g) * 0.5
            elif "norm" in name:
                # linear_attn.norm is a plain-weight gated norm (around 1); the others are
                # zero-centred (1 + w).
                base = 1.0 if "linear_attn.norm" in name else 0.0
                v = base + torch.randn(p.shape, generator=g) * 0.1
            elif "embed_tokens" in name:
                v = torch.randn(p.shape, generator=g)
            elif p.dim() == 2:
                v = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1])
            else:
                raise SystemExit(f"ref_qwen35: no rule to initialise {name} {tuple(p.shape)}")
            # bf16-representable, so the saved bf16 file holds exactly these values.
            p.copy_(v.to(torch.bfloat16).to(torch.float32))


def greedy(model):
    ids = list(PROMPT)
    tokens, logits, margins = [], [], []
    with torch.no_grad():
        for _ in range(STEPS):
            out = model(torch.tensor([ids])).logits[0, -1].to(torch.float64)
            top = torch.topk(out, 2)
            t = int(top.indices[0])
            tokens.append(t)
            logits.append([float(x) for x in out.tolist()])
            margins.append(float(top.values[0] - top.values[1]))
            ids.append(t)
    return tokens, logits, margins


def reference(model, path, extra):
    import transformers

    tokens, logits, margins = greedy(model)
    doc = {
        "prompt": PROMPT,
        "tokens": tokens,
        "logits": logits,
        "margins": margins,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        **extra,
    }
    with open(path, "w") as f:
        json.dump(doc, f)
    print(f"{path}: tokens {tokens}, smallest margin {min(margins):.4f}")


def quantize(w):
    """GPTQ int4, sym, per group of GROUP along K: w [N, K] f32 → (qweight [K/8, N] i32,
    qzeros [K/G, N/8] i32 (v1: 7 stored for z = 8), scales [K/G, N] f16, g_idx [K] i32, the
    dequantised twin [N, K] f32)."""
    n, k = w.shape
    wg = w.t().reshape(k // GROUP, GROUP, n)  # [groups, G, N]
    scales = (wg.abs().amax(dim=1) / 7.0).clamp(min=1e-6).to(torch.float16)  # [groups, N]
    s = scales.to(torch.float32).unsqueeze(1)
    q = torch.clamp(torch.round(wg / s) + 8, 0, 15).to(torch.int64)  # [groups, G, N]
    twin = ((q - 8).to(torch.float32) * s).reshape(k, n).t().contiguous()
    q = q.reshape(k, n)
    qweight = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        qweight |= q[j::8] << (4 * j)
    zeros = torch.full((k // GROUP, n), 7, dtype=torch.int64)
    qzeros = torch.zeros(k // GROUP, n // 8, dtype=torch.int64)
    for j in range(8):
        qzeros |= zeros[:, j::8] << (4 * j)
    def as_i32(t):  # the low 32 bits, as the signed int32 GPTQ files hold
        return ((t + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)

    g_idx = torch.arange(k, dtype=torch.int32) // GROUP
    return as_i32(qweight), as_i32(qzeros), scales, g_idx, twin


def main():
    from safetensors.torch import save_file
    from transformers import Qwen3_5ForCausalLM

    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    out = sys.argv[1]
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config()).to(torch.float32).eval()
    init(model)

    dense = os.path.join(out, "qwen35-tiny")
    model.to(torch.bfloat16).save_pretrained(dense)
    model.to(torch.float32)
    reference(model, os.path.join(dense, "reference.json"), {})

    # The GPTQ variant: MLP projections quantized, everything else as in the dense model.
    gptq = os.path.join(out, "qwen35-tiny-gptq")
    os.makedirs(gptq, exist_ok=True)
    tensors = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            module = name[: -len(".weight")]
            if ".mlp." in name and name.endswith("proj.weight"):
                qw, qz, sc, gi, twin = quantize(p.detach().to(torch.float32))
                tensors[f"{module}.qweight"] = qw
                tensors[f"{module}.qzeros"] = qz
                tensors[f"{module}.scales"] = sc
                tensors[f"{module}.g_idx"] = gi
                p.copy_(twin)
            else:
                tensors[name] = p.detach().to(torch.bfloat16).contiguous()
    save_file(tensors, os.path.join(gptq, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dense, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP,
        "sym": True,
        "desc_act": False,
        "checkpoint_format": "gptq",
        "dynamic": {"-:.*(self_attn|linear_attn).*": {}},
    }
    with open(os.path.join(gptq, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    reference(model, os.path.join(gptq, "reference.json"), {"twin": "dequantised f32, (q - z) * s"})


if __name__ == "__main__":
    main()
