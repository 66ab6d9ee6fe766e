"""gnmr_jax: GNMR runtime stability control for low-precision LLM training in JAX."""
