"""The primary (target) decoder service: the model, every request's KV cache, tree verify."""
