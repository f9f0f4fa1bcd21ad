"""Model building blocks, one file per layer kind."""
