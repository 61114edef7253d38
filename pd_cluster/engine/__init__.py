"""The serving engine shared by every role: KV memory, prefix cache, scheduler, sampler."""
