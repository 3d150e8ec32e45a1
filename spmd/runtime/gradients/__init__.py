"""Gradients: the layout each one is reduced to (layouts), reductions that span blocks in fixed-size buffers
(reducer), the reduction a ZeRO-1 step makes (step_reduce), and accumulation through compiled blocks (accumulate)."""

__all__: list[str] = []
