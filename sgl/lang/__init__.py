"""The prompt-program DSL (`@sgl.function`, `gen`, `select`, roles, fork/join); never imports torch."""
