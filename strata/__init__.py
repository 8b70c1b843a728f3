"""Strata: a Qwen3.8-Flash-Next (qwen4exp) inference engine."""
