"""Activations: layout decisions and moves (moves, `constrain`), partial sums reduced (partials), the global view
(global_view), the loss over every rank's tokens (loss), attention memory observed (attention_memory).
"""

__all__: list[str] = []
