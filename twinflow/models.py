"""Published OPT model shapes as transformers configs (no download), for examples, benchmarks and tuning."""

from __future__ import annotations

import torch

# Published OPT shapes: (layers, hidden, ffn, heads, word_embed_proj_dim).
OPT_SHAPES = {
    "opt-tiny": (2, 64, 256, 4, 64),  # for smoke runs on a CPU
    "opt-125m": (12, 768, 3072, 12, 768),
    "opt-350m": (24, 1024, 4096, 16, 512),
    "opt-1.3b": (24, 2048, 8192, 32, 2048),
    "opt-2.7b": (32, 2560, 10240, 32, 2560),
    "opt-6.7b": (32, 4096, 16384, 32, 4096),
    "opt-13b": (40, 5120, 20480, 40, 5120),
    "opt-30b": (48, 7168, 28672, 56, 7168),
}


def opt_config(name: str):
    """transformers' OPTConfig for a published OPT size (no download), dropout off, no KV cache."""
    from transformers import OPTConfig

    if name not in OPT_SHAPES:
        raise ValueError(f"model {name!r}; expected one of {sorted(OPT_SHAPES)}")
    layers, hidden, ffn, heads, proj = OPT_SHAPES[name]
    return OPTConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        ffn_dim=ffn,
        num_attention_heads=heads,
        word_embed_proj_dim=proj,
        dropout=0.0,
        attention_dropout=0.0,
        use_cache=False,
        do_layer_norm_before=name != "opt-350m",
    )


def build_opt(name: str, device: str | torch.device, dtype: torch.dtype, checkpointing: bool = True):
    """A randomly initialised OPTForCausalLM, materialised directly on `device`, in training mode."""
    from transformers import OPTForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in the training dtype: no fp32 copy of a large model on the way
    try:
        with torch.device(device):
            model = OPTForCausalLM(opt_config(name))
    finally:
        torch.set_default_dtype(previous)
    model.to(dtype)  # buffers and anything made outside the default dtype
    if checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # older transformers
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model
