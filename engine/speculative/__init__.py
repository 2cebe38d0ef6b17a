"""Speculative decoding with the DSpark drafter and scheduled verification (`dspark.md`)."""
