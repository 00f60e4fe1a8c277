"""Model families: HF config -> ModelSpec (pure), HF <-> Megatron name/shape mapping (pure), and
the provider that builds megatron-core GPTModels (imports megatron-core)."""
