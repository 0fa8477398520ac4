"""Image inputs: LLaVA checkpoints' vision encoders (:mod:`.vision`), the engine's image handling (:mod:`.images`)
and the runner's encoder cache (:mod:`.runner`)."""
