"""Model-family adapters, one module per family."""
