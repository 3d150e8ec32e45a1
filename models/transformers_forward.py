"""The trainer's forward for a transformers causal LM (`--model hf:DIR`, models.transformers_lm): the loss of
`kernels` on its logits, and under context parallelism the data path's positions with a causal SDPA.
"""

import contextlib

import kernels


def train_forward(self, tokens, targets=None, positions=None):
    """The trainer's call: the mean cross-entropy of `targets` (already shifted), plus the router's
    load-balancing loss where the config asks for it (`output_router_logits`), or the logits. The loss is
    kernels' (vocab-parallel on sharded logits) rather than transformers', which would gather the logits and
    shift its labels inside the model, wrong on a sequence in another order than its own (cp's zigzag).
    `positions` [B, T]: each token's position, when the data path gives the sequence in another order
    (context parallelism); transformers rotates RoPE by them."""
    if positions is None:
        out = type(self).forward(self, input_ids=tokens)
    else:
        with causal_sdpa(self.config):
            out = type(self).forward(self, input_ids=tokens, position_ids=positions)
    if targets is None:
        return out.logits
    loss = kernels.cross_entropy(out.logits.float(), targets, impl=self.cfg.kernels)
    if getattr(out, "aux_loss", None) is not None:  # a mixture of experts' load-balancing loss, as transformers adds it
        loss = loss + self.config.router_aux_loss_coef * out.aux_loss
    return loss


CAUSAL_SDPA = "spmd_causal_sdpa"


@contextlib.contextmanager
def causal_sdpa(config):
    """transformers' own SDPA attention, under a name with no mask builder: transformers then builds no mask
    and SDPA gets is_causal. Its mask builder would read position ids that do not count up by one as
    sequences packed in a row and mask each from the others; the rows here are whole sequences, reordered."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if problem := window_problem(config.to_dict()):
        raise ValueError(problem)
    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    saved, config._attn_implementation = config._attn_implementation, CAUSAL_SDPA
    try:
        yield
    finally:
        config._attn_implementation = saved


def window_problem(hf: dict) -> str | None:
    """Why this config's attention cannot run as a causal ring over cp (it attends within windows), or None."""
    windows = {
        k: v
        for k in ("sliding_window", "attention_chunk_size")
        if (v := hf.get(k)) and hf.get("use_sliding_window") is not False
    }
    return (
        (
            f"attention within windows {windows} needs a mask, and ring attention over cp takes only the causal "
            f"one; use a mesh without cp"
        )
        if windows
        else None
    )
