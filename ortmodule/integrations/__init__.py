"""Integrations with training frameworks (imported on demand: ``ortmodule.integrations.transformers``)."""
