"""Llama-family models written for this engine: weights (loading) split from inference."""
