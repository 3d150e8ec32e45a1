"""Expert parallelism: tokens sent to their experts' ranks and back (dispatch, all_to_all), also for expert modules
that route their tokens themselves (routed_dispatch, whole_experts)."""

__all__: list[str] = []
