"""Loading a Hugging Face causal LM the same way in every script that compares with tprun
(scripts/hf_reference.py, scripts/peer_hf_decode.py): the dtype keyword this transformers
version understands, straight to the device where it can, eval mode.
"""


def transformers_version():
    import transformers

    parts = []
    for x in transformers.__version__.split(".")[:2]:
        digits = "".join(ch for ch in x if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 2:
        parts.append(0)
    return tuple(parts)


def load_model(path, dtype, device, attn="sdpa", log=print):
    """from_pretrained with the dtype keyword this transformers version understands; weights end
    up on `device` in `dtype`. `log` hears of fallbacks."""
    import torch
    from transformers import AutoModelForCausalLM

    # transformers >= 4.56 takes `dtype=`; older ones take `torch_dtype=` (and would silently
    # store an unknown `dtype=` in the config, loading f32 weights).
    dkey = "dtype" if transformers_version() >= (4, 56) else "torch_dtype"
    kw = {dkey: dtype, "attn_implementation": attn}
    model = None
    if str(device).startswith("cuda"):
        try:
            model = AutoModelForCausalLM.from_pretrained(path, device_map=str(device), **kw)
        except (ImportError, ValueError, TypeError, RuntimeError) as e:
            log(f"loading with device_map={device} failed ({type(e).__name__}: {e}); "
                "loading on the CPU, then moving")
            model = None
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(path, **kw)
    model = model.to(device)
    pdt = next(model.parameters()).dtype
    if pdt != dtype:
        log(f"weights loaded as {pdt}; converting to {dtype}")
        model = model.to(dtype)
    model.eval()
    return model
