"""Activations: the layout decisions and the moves that carry them out (moves, `constrain`), where partial sums are
reduced (partials), the global view a model runs under (global_view), the loss over every rank's tokens (loss), and
attention memory observed while it runs (attention_memory)."""

__all__: list[str] = []
