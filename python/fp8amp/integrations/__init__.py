"""Adapters for training frameworks (docs/integrations.md). Each submodule imports its framework,
so ``import fp8amp`` needs none of them: ``fp8amp.integrations.lightning`` needs ``lightning``."""
